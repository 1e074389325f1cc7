// (being written)
#include "../graph.h"
namespace recurra {
void register_ssm_ops(OpTable&) {}
}  // namespace recurra
