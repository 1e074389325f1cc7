// (being written)
#include "../graph.h"
namespace recurra {
void register_nn_ops(OpTable&) {}
}  // namespace recurra
