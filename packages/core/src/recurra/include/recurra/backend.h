/* recurra backend interface (C ABI).
 *
 * A backend plugin (a separate wheel, e.g. recurra-vulkan) fills a recurra_backend_table
 * and hands it to the core as a PyCapsule named "recurra.backend_table" from the function
 * its `recurra.backends` entry point names. The core checks `abi_version` against
 * RECURRA_BACKEND_ABI_VERSION at registration and refuses a mismatch with a clear error.
 * Only plain C types cross the boundary: no C++ or pybind11 types.
 *
 * Shapes are numpy order (axis ndim-1 is the fastest); strides count elements.
 * Every function returns 0 on success or a negative recurra_status; on failure it may
 * write a message into the backend's last-error buffer (get_last_error).
 */
#ifndef RECURRA_BACKEND_H
#define RECURRA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: RECURRA_MAX_SRC 8 -> 12 (ssm_scan_back with the forward's checkpoints takes 9)
 * 3: recurra_device_info gains max_buffer_bytes, max_tensor_elements and free_bytes (the
 *    planner splits a device's arena into buffers no larger than max_buffer_bytes and
 *    refuses a tensor that one buffer cannot hold)
 * 4: recurra/op_spec.h declares every op (sources, parameters, codes); act_grad's code is
 *    now the activation's RECURRA_UNARY_* code (was 0 abs .. 9 softplus)
 * 5: dtypes RECURRA_BF16 and RECURRA_F16 (2 bytes an element; strides still count
 *    elements, offsets bytes); the op "cast"; RECURRA_OPS_HALF in op_spec.h lists the ops
 *    that take them. A backend without kernels for them answers supports_op = 0 for a node
 *    with such a tensor (the core then runs it on the CPU, or refuses under strict placement)
 * 6: optional alloc_host, mark and wait_mark (asynchronous reads: a compute copies values
 *    into host-visible memory, the host waits for that submission only)
 * 7: optional import_host (a buffer over host memory the caller allocated, e.g. a shared
 *    memory segment of several processes: a device copy lands there without another copy) */
#define RECURRA_BACKEND_ABI_VERSION 7
#define RECURRA_MAX_DIMS 4
#define RECURRA_MAX_SRC 12

typedef enum recurra_dtype {
  RECURRA_F32 = 0,
  RECURRA_I32 = 1,
  RECURRA_BF16 = 2, /* bfloat16: float32's top 16 bits (8-bit exponent, 7-bit mantissa) */
  RECURRA_F16 = 3   /* IEEE 754 binary16 (5-bit exponent, 10-bit mantissa) */
} recurra_dtype;

typedef enum recurra_status {
  RECURRA_OK = 0,
  RECURRA_ERR_INVALID = -1,     /* bad arguments: becomes ValueError */
  RECURRA_ERR_OOM = -2,         /* out of device memory: becomes MemoryError (the message
                                   says which pool, the bytes asked, the limit, what is free) */
  RECURRA_ERR_DEVICE_LOST = -3, /* the device went away: becomes RuntimeError */
  RECURRA_ERR_UNSUPPORTED = -4  /* the op or layout is not supported here */
} recurra_status;

/* Memory on a backend. `generation` changes whenever the handle is freed, so a stale copy of
 * a handle is detected instead of reading freed memory. */
typedef struct recurra_buffer {
  uint64_t handle;     /* backend-defined */
  uint64_t generation; /* 0 = invalid */
  size_t nbytes;
} recurra_buffer;

/* A tensor as a backend sees it: a strided window into a buffer. */
typedef struct recurra_tensor_desc {
  recurra_dtype dtype;
  int32_t ndim;
  int64_t shape[RECURRA_MAX_DIMS];
  int64_t strides[RECURRA_MAX_DIMS]; /* in elements */
  recurra_buffer buffer;
  size_t offset; /* in bytes, into buffer */
} recurra_tensor_desc;

/* One node of a sub-graph handed to a backend. */
typedef struct recurra_node_desc {
  const char* op; /* the op table's name, e.g. "ssm_scan" or "ssm_scan_back" */
  recurra_tensor_desc dst;
  int32_t n_src;
  recurra_tensor_desc src[RECURRA_MAX_SRC];
  int32_t n_ip;
  const int64_t* ip; /* integer parameters, as recurra/op_spec.h declares them */
  int32_t n_fp;
  const double* fp; /* float parameters */
} recurra_node_desc;

typedef struct recurra_device_info {
  char name[256];
  char kind[32]; /* "gpu", "cpu", "integrated" */
  uint64_t memory_bytes;
  uint32_t index;
  /* The largest single buffer (alloc) the device takes: no tensor may be larger, and the
   * core splits a graph's arena on this device into buffers of at most this many bytes.
   * 0: no limit. */
  uint64_t max_buffer_bytes;
  /* The most elements one tensor on the device may have (e.g. 2^31 - 1 where kernels index
   * with 32-bit integers). 0: no limit. */
  uint64_t max_tensor_elements;
  /* Device memory free for new buffers now (the driver's budget where it has one); 0:
   * unknown. */
  uint64_t free_bytes;
} recurra_device_info;

/* What to try after running out of memory: both sides append it to their MemoryError. */
#define RECURRA_OOM_HINT                                                                     \
  "try a smaller batch or sequence, or gradient checkpointing: "                             \
  "model.gradient_checkpointing(True) / recurra train --gradient-checkpointing"

typedef struct recurra_backend_table {
  uint32_t abi_version; /* RECURRA_BACKEND_ABI_VERSION */
  const char* name;     /* "vulkan" */
  void* ctx;            /* passed back as the first argument of every call */

  /* Devices. */
  int (*device_count)(void* ctx);
  int (*device_info)(void* ctx, int device, recurra_device_info* out);

  /* Memory: allocate/free a buffer on a device; copies to/from host memory. */
  int (*alloc)(void* ctx, int device, size_t nbytes, int persistent, recurra_buffer* out);
  int (*free)(void* ctx, int device, recurra_buffer buf);
  int (*copy_in)(void* ctx, int device, recurra_buffer dst, size_t offset, const void* src,
                 size_t nbytes);
  int (*copy_out)(void* ctx, int device, recurra_buffer src, size_t offset, void* dst,
                  size_t nbytes);

  /* Can this backend run this node? (the scheduler's per-node question) */
  int (*supports_op)(void* ctx, int device, const recurra_node_desc* node);

  /* Runs a sub-graph (a split) in order; may return before the work is done. */
  int (*compute)(void* ctx, int device, const recurra_node_desc* nodes, int32_t n_nodes);
  /* Waits for all submitted work. */
  int (*synchronize)(void* ctx, int device);

  /* (optional) The message of the last failed call, or NULL. */
  const char* (*get_last_error)(void* ctx);
  /* (optional) Releases everything; the table must not be used afterwards. */
  void (*shutdown)(void* ctx);

  /* (optional, ABI 6; all three or none) Asynchronous reads.
   * alloc_host: a buffer in host-visible, host-coherent memory (host-cached where the device
   * has it) that nodes may read and write like any buffer; *host: its address, valid until it
   * is freed (with free()). What a compute writes there is visible at *host once the compute's
   * mark was waited for; what the host writes there before a compute call, that compute reads.
   * mark: a value standing for all work submitted so far (compute calls included).
   * wait_mark: waits until the work that `value` stands for is done, not for later work. */
  int (*alloc_host)(void* ctx, int device, size_t nbytes, recurra_buffer* out, void** host);
  int (*mark)(void* ctx, int device, uint64_t* value);
  int (*wait_mark)(void* ctx, int device, uint64_t value);

  /* (optional, ABI 7; needs the three above) import_host: a buffer over `nbytes` of host
   * memory at `host` that the caller allocated (e.g. a page-aligned shared-memory segment),
   * which nodes and copies use like alloc_host's buffers (*host is its address). `host` and
   * `nbytes` must be multiples of the device's import alignment (a page); the memory must stay
   * valid until the buffer is freed (with free()). RECURRA_ERR_UNSUPPORTED where the device
   * cannot import that memory (no VK_EXT_external_memory_host, the alignment, the driver). */
  int (*import_host)(void* ctx, int device, void* host, size_t nbytes, recurra_buffer* out);
} recurra_backend_table;

#ifdef __cplusplus
}
#endif

#endif /* RECURRA_BACKEND_H */
