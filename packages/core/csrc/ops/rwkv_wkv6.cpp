// (being written)
#include "../graph.h"
namespace recurra {
void register_rwkv_ops(OpTable&) {}
}  // namespace recurra
