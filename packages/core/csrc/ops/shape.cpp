// (being written)
#include "../graph.h"
namespace recurra {
void register_shape_ops(OpTable&) {}
}  // namespace recurra
