// The op table is assembled here: one register_*_ops function per file in ops/.
#include "../graph.h"

namespace recurra {

void register_view_ops(OpTable& t);         // views.cpp
void register_elementwise_ops(OpTable& t);  // elementwise.cpp
void register_reduce_ops(OpTable& t);       // reduce.cpp
void register_matmul_ops(OpTable& t);       // matmul.cpp
void register_nn_ops(OpTable& t);           // nn.cpp
void register_shape_ops(OpTable& t);        // shape.cpp
void register_ssm_ops(OpTable& t);          // ssm_conv.cpp, ssm_scan/op.cpp
void register_rwkv_ops(OpTable& t);         // rwkv_wkv6.cpp, rwkv_wkv7.cpp, gated_linear_attn.cpp
void register_optim_ops(OpTable& t);        // optim_kernels.cpp

void register_all_ops(OpTable& t) {
  register_view_ops(t);
  register_elementwise_ops(t);
  register_reduce_ops(t);
  register_matmul_ops(t);
  register_nn_ops(t);
  register_shape_ops(t);
  register_ssm_ops(t);
  register_rwkv_ops(t);
  register_optim_ops(t);
}

}  // namespace recurra
