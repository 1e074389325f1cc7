// recurra_vulkan._vk: the backend table as a PyCapsule, and test/benchmark entry points that
// run single nodes through the same table functions the core calls.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

#include "backend.h"
#include "coopmat.h"
#include "ops/ops.h"

namespace py = pybind11;
using namespace recurra_vk;

namespace {

std::string version_str(uint32_t v) {
  return std::to_string(VK_API_VERSION_MAJOR(v)) + "." + std::to_string(VK_API_VERSION_MINOR(v)) + "." +
         std::to_string(VK_API_VERSION_PATCH(v));
}

// Throws the Error matching a failed table call (the module's exception translator turns it
// into ValueError, MemoryError, NotImplementedError or RuntimeError; no Python API is
// touched here, so this is safe without the GIL).
void check(int st, const std::string& what) {
  if (st == RECURRA_OK) return;
  const char* m = backend_table()->get_last_error(nullptr);
  throw Error(st, what + ": " + (m ? m : "failed"));
}

// Buffers of one node run, freed on scope exit.
struct NodeRun {
  int device;
  std::vector<recurra_buffer> bufs;
  recurra_node_desc node{};
  std::string op;
  std::vector<int64_t> ip;
  std::vector<double> fp;
  std::vector<ssize_t> out_shape;
  recurra_dtype out_dtype = RECURRA_F32;

  explicit NodeRun(int dev) : device(dev) {}
  ~NodeRun() {
    for (const auto& b : bufs) backend_table()->free(nullptr, device, b);
  }

  recurra_buffer alloc(size_t n) {
    recurra_buffer b{};
    check(backend_table()->alloc(nullptr, device, std::max<size_t>(n, 4), 0, &b), "alloc");
    bufs.push_back(b);
    return b;
  }

  // Uploads the memory a (possibly strided) numpy view spans and describes the view.
  recurra_tensor_desc upload(const py::array& a, size_t offset) {
    recurra_tensor_desc d{};
    const std::string name = py::str(a.dtype());
    if (a.dtype().is(py::dtype::of<float>()))
      d.dtype = RECURRA_F32;
    else if (a.dtype().is(py::dtype::of<int32_t>()))
      d.dtype = RECURRA_I32;
    else if (name == "bfloat16" && a.itemsize() == 2)  // ml_dtypes.bfloat16
      d.dtype = RECURRA_BF16;
    else if (name == "float16")
      d.dtype = RECURRA_F16;
    else
      throw py::type_error("sources must be float32, int32, bfloat16 or float16 arrays, got " + name);
    const ssize_t e = a.itemsize();
    if (a.ndim() > RECURRA_MAX_DIMS) throw py::value_error("at most 4 axes");
    if (offset % 4) throw py::value_error("src_offset must be a multiple of 4");
    d.ndim = static_cast<int32_t>(a.ndim());
    int64_t span = 0;
    bool empty = false;
    for (int i = 0; i < RECURRA_MAX_DIMS; ++i) {
      d.shape[i] = 1;
      d.strides[i] = 1;
    }
    for (int i = 0; i < d.ndim; ++i) {
      const ssize_t st = a.strides(i);
      if (st < 0 || st % e) throw py::value_error("source strides must be non-negative multiples of the item size");
      d.shape[i] = a.shape(i);
      d.strides[i] = st / e;
      if (a.shape(i) == 0) empty = true;
      span += (a.shape(i) - 1) * d.strides[i];
    }
    const size_t bytes = empty ? 0 : static_cast<size_t>(span + 1) * static_cast<size_t>(e);
    d.buffer = alloc(offset + bytes);
    d.offset = offset;
    if (bytes) check(backend_table()->copy_in(nullptr, device, d.buffer, offset, a.data(), bytes), "copy_in");
    return d;
  }

  void setup(const std::string& op_name, const std::vector<py::array>& srcs, const std::vector<int64_t>& ips,
             const std::vector<double>& fps, const std::vector<ssize_t>& shape, const std::string& dtype,
             size_t src_offset) {
    if (srcs.size() > RECURRA_MAX_SRC) throw py::value_error("at most " + std::to_string(RECURRA_MAX_SRC) + " sources");
    if (shape.size() > RECURRA_MAX_DIMS) throw py::value_error("at most 4 axes");
    static const std::pair<const char*, recurra_dtype> kOut[] = {
        {"float32", RECURRA_F32}, {"int32", RECURRA_I32}, {"bfloat16", RECURRA_BF16}, {"float16", RECURRA_F16}};
    const auto* o_dt = std::find_if(std::begin(kOut), std::end(kOut), [&](const auto& x) { return dtype == x.first; });
    if (o_dt == std::end(kOut)) throw py::type_error("out_dtype must be 'float32', 'int32', 'bfloat16' or 'float16'");
    op = op_name;
    ip = ips;
    fp = fps;
    out_shape = shape;
    out_dtype = o_dt->second;
    node.op = op.c_str();
    node.n_src = static_cast<int32_t>(srcs.size());
    for (size_t i = 0; i < srcs.size(); ++i) node.src[i] = upload(srcs[i], src_offset);
    node.n_ip = static_cast<int32_t>(ip.size());
    node.ip = ip.data();
    node.n_fp = static_cast<int32_t>(fp.size());
    node.fp = fp.data();
    recurra_tensor_desc& o = node.dst;
    o.dtype = out_dtype;
    o.ndim = static_cast<int32_t>(shape.size());
    int64_t n = 1;
    for (int i = 0; i < RECURRA_MAX_DIMS; ++i) o.shape[i] = 1, o.strides[i] = 1;
    for (int i = o.ndim - 1; i >= 0; --i) {
      if (shape[i] < 0) throw py::value_error("negative output dimension");
      o.shape[i] = shape[i];
      o.strides[i] = n;
      n *= shape[i];
    }
    o.buffer = alloc(static_cast<size_t>(n) * out_bytes());
    o.offset = 0;
    // The placement question first, exactly as the scheduler asks it.
    if (backend_table()->supports_op(nullptr, device, &node) != 1) {
      const char* m = backend_table()->get_last_error(nullptr);
      throw Error(RECURRA_ERR_UNSUPPORTED, "the Vulkan backend does not support this " + op + " node: " + (m ? m : "?"));
    }
  }

  void compute() {
    check(backend_table()->compute(nullptr, device, &node, 1), "compute");
    check(backend_table()->synchronize(nullptr, device), "synchronize");
  }

  size_t out_bytes() const { return out_dtype == RECURRA_BF16 || out_dtype == RECURRA_F16 ? 2 : 4; }

  // The output; a 2-byte one as its bits (uint16).
  py::array read() {
    py::array out = out_dtype == RECURRA_F32   ? py::array(py::dtype::of<float>(), out_shape)
                    : out_dtype == RECURRA_I32 ? py::array(py::dtype::of<int32_t>(), out_shape)
                                               : py::array(py::dtype::of<uint16_t>(), out_shape);
    const size_t bytes = static_cast<size_t>(out.size()) * out_bytes();
    if (bytes)
      check(backend_table()->copy_out(nullptr, device, node.dst.buffer, 0, out.mutable_data(), bytes), "copy_out");
    return out;
  }
};

py::dict backend_info() {
  BackendSummary s = backend_summary();
  py::list devices;
  for (size_t i = 0; i < s.devices.size(); ++i) {
    const PhysicalDevice& d = s.devices[i];
    py::dict e;
    e["index"] = i;
    e["name"] = d.name;
    e["kind"] = d.kind;
    e["memory_bytes"] = d.memory_bytes;
    e["max_buffer_bytes"] = d.max_buffer_bytes();
    e["memory_budget"] = d.memory_budget;
    e["driver"] = d.driver;
    e["api_version"] = version_str(d.api_version);
    e["vk_index"] = d.vk_index;
    e["coopmat"] = d.coopmat.summary();
    e["half_storage"] = d.storage16;
    e["max_shared_bytes"] = d.max_shared_bytes;
    devices.append(e);
  }
  py::dict out;
  out["devices"] = devices;
  // "reason" is empty whenever there is a device (the core reads a reason as "unusable");
  // devices that were passed over are listed under "skipped".
  out["reason"] = s.devices.empty() ? s.reason : std::string();
  if (!s.devices.empty() && !s.reason.empty()) out["skipped"] = s.reason;
  if (!s.devices.empty()) out["table"] = py::capsule(static_cast<void*>(backend_table()), "recurra.backend_table");
  return out;
}

// Runs one node warmup + iters times and returns the timestamp records of the last iters runs:
// one per node, or one per dispatch when per_dispatch.
std::vector<ProfileRecord> profile_runs(const std::string& op, const std::vector<py::array>& srcs,
                                        const std::vector<int64_t>& ip, const std::vector<double>& fp,
                                        const std::vector<ssize_t>& out_shape, const std::string& out_dtype,
                                        int iters, int warmup, int device, bool per_dispatch) {
  NodeRun r(device);
  r.setup(op, srcs, ip, fp, out_shape, out_dtype, 0);
  std::vector<ProfileRecord> recs;
  bool was = false;
  auto restore = [&](Device& d) {
    d.set_profile_sink(nullptr);
    if (per_dispatch) d.set_profile_dispatches(was);
  };
  py::gil_scoped_release nogil;
  for (int i = 0; i < warmup; ++i) r.compute();
  with_device(device, [&](Device& d) {
    if (d.info().timestamp_bits == 0) fail_invalid("this device's queue has no timestamps");
    was = d.profiling_dispatches();
    if (per_dispatch) d.set_profile_dispatches(true);
    d.set_profile_sink(&recs);
  });
  try {
    for (int i = 0; i < iters; ++i) r.compute();
  } catch (...) {
    with_device(device, restore);
    throw;
  }
  with_device(device, restore);
  return recs;
}

}  // namespace

PYBIND11_MODULE(_vk, m) {
  m.doc() = "recurra's Vulkan backend (native part)";
  m.attr("ABI_VERSION") = RECURRA_BACKEND_ABI_VERSION;
  m.attr("MAX_SRC") = RECURRA_MAX_SRC;
  {
    py::dict tiles;
    for (const std::string& v : coopmat_variants()) {
      int64_t bm = 0, bn = 0, bk = 0;
      coopmat_tile(v, bm, bn, bk);
      tiles[py::str(v)] = py::make_tuple(bm, bn, bk);
    }
    m.attr("COOPMAT_TILES") = tiles;
  }
  m.def("backend_info", &backend_info,
        "Returns {'devices': [...], 'reason': str, 'table': PyCapsule} ('table' only when there are devices).");
  m.def("op_names", &op_names, "Names of the ops with a Vulkan kernel.");
  m.def(
      "run_node",
      [](const std::string& op, const std::vector<py::array>& srcs, const std::vector<int64_t>& ip,
         const std::vector<double>& fp, const std::vector<ssize_t>& out_shape, const std::string& out_dtype,
         size_t src_offset, int device) {
        NodeRun r(device);
        r.setup(op, srcs, ip, fp, out_shape, out_dtype, src_offset);
        {
          py::gil_scoped_release nogil;
          r.compute();
        }
        return r.read();
      },
      py::arg("op"), py::arg("srcs"), py::arg("ip") = std::vector<int64_t>{}, py::arg("fp") = std::vector<double>{},
      py::arg("out_shape"), py::arg("out_dtype") = "float32", py::arg("src_offset") = 0, py::arg("device") = 0,
      "Runs one node through the backend table: allocates, uploads the sources (float32, int32, bfloat16 or "
      "float16; numpy views keep their strides; each is placed src_offset bytes into its buffer), asks "
      "supports_op, computes, synchronizes, reads back (a bfloat16/float16 output as its bits, uint16). "
      "Raises NotImplementedError when the node is not supported, ValueError/MemoryError/RuntimeError for failures.");
  m.def(
      "profile_node",
      [](const std::string& op, const std::vector<py::array>& srcs, const std::vector<int64_t>& ip,
         const std::vector<double>& fp, const std::vector<ssize_t>& out_shape, const std::string& out_dtype,
         int iters, int warmup, int device) {
        std::vector<double> secs;
        for (const auto& p : profile_runs(op, srcs, ip, fp, out_shape, out_dtype, iters, warmup, device, false))
          secs.push_back(p.seconds);
        return secs;
      },
      py::arg("op"), py::arg("srcs"), py::arg("ip") = std::vector<int64_t>{}, py::arg("fp") = std::vector<double>{},
      py::arg("out_shape"), py::arg("out_dtype") = "float32", py::arg("iters") = 10, py::arg("warmup") = 2,
      py::arg("device") = 0,
      "Like run_node, but runs the node warmup + iters times and returns the GPU time of each of the last iters "
      "runs in seconds (timestamp queries).");
  m.def(
      "profile_dispatches",
      [](const std::string& op, const std::vector<py::array>& srcs, const std::vector<int64_t>& ip,
         const std::vector<double>& fp, const std::vector<ssize_t>& out_shape, const std::string& out_dtype,
         int iters, int warmup, int device) {
        py::list out;
        for (const auto& p : profile_runs(op, srcs, ip, fp, out_shape, out_dtype, iters, warmup, device, true))
          out.append(py::make_tuple(p.op, p.seconds));
        return out;
      },
      py::arg("op"), py::arg("srcs"), py::arg("ip") = std::vector<int64_t>{}, py::arg("fp") = std::vector<double>{},
      py::arg("out_shape"), py::arg("out_dtype") = "float32", py::arg("iters") = 10, py::arg("warmup") = 2,
      py::arg("device") = 0,
      "Like profile_node, but times each dispatch: returns (label, seconds) for every dispatch of the last iters "
      "runs, labelled 'op/shader[specialization constants]', in recording order.");
  m.def(
      "memory_info",
      [](int device, bool reset_peaks) {
        DeviceMemory::Stats st;
        with_device(device, [&](Device& d) {
          st = d.memory().stats();
          if (reset_peaks) d.memory().reset_peaks();
        });
        py::dict out;
        const char* const pools[3] = {"persistent", "transient", "internal"};
        for (int p = 0; p < 3; ++p) {
          py::dict e;
          e["bytes_in_use"] = st.in_use[p];
          e["peak_bytes"] = st.peak_in_use[p];
          out[pools[p]] = e;
        }
        out["reserved_bytes"] = st.reserved;
        out["peak_reserved_bytes"] = st.peak_reserved;
        out["idle_bytes"] = st.idle_bytes;
        out["blocks"] = st.blocks;
        out["blocks_made"] = st.blocks_made;
        return out;
      },
      py::arg("device") = 0, py::arg("reset_peaks") = false,
      "Device memory recurra holds on one device: per pool (persistent, transient, internal: op scratch) the bytes "
      "in use and their peak; reserved_bytes (all blocks) and its peak; idle_bytes (empty blocks kept for reuse); "
      "blocks; blocks_made (driver allocations since the start). reset_peaks: set the peaks to what is held now (after reading them).");
  m.def(
      "replay_info",
      [](int device) {
        std::pair<uint64_t, uint64_t> c;
        with_device(device, [&](Device& d) { c = d.replay_counts(); });
        py::dict out;
        out["recorded"] = c.first;
        out["replayed"] = c.second;
        return out;
      },
      py::arg("device") = 0,
      "How the device's graph computes of 16 nodes or more were submitted since it opened: 'recorded' (the "
      "dispatches recorded afresh: a node list not seen before, or one whose buffers, offsets or shapes changed) "
      "and 'replayed' (a kept recording of the same node list resubmitted as is). A training loop whose steps "
      "replay spends no host time recording.");
  m.def(
      "coopmat_info",
      [](int device) {
        BackendSummary s = backend_summary();
        if (device < 0 || static_cast<size_t>(device) >= s.devices.size())
          throw py::value_error("no Vulkan device " + std::to_string(device) + " (there are " +
                                std::to_string(s.devices.size()) + ")");
        const CoopMatCaps& c = s.devices[device].coopmat;
        py::dict out;
        out["built"] = coopmat_built();
        out["build_note"] = std::string(coopmat_build_note());
        out["extension"] = c.extension;
        out["feature"] = c.feature;
        out["bf16_extension"] = c.bf16_extension;
        out["bf16_type"] = c.bf16_type;
        out["bf16_coopmat"] = c.bf16_coopmat;
        out["float16"] = c.float16;
        out["memory_model"] = c.memory_model;
        out["subgroup_size"] = c.subgroup_size;
        out["max_shared_bytes"] = c.max_shared_bytes;
        py::list shapes;
        for (const CoopMatShape& sh : c.shapes) shapes.append(sh.str());
        out["shapes"] = shapes;
        out["f16"] = c.why_not(false).empty();
        out["bf16"] = c.why_not(true).empty();
        out["f16_reason"] = c.why_not(false);
        out["bf16_reason"] = c.why_not(true);
        out["summary"] = c.summary();
        out["variants"] = coopmat_variants();
        return out;
      },
      py::arg("device") = 0,
      "What device `device` offers for the tensor-core (VK_KHR_cooperative_matrix) matmul: the build's "
      "shaders and note, the extensions and features, the cooperative matrix shapes, and per dtype whether it "
      "runs ('f16', 'bf16') or why not ('f16_reason', 'bf16_reason').");
  m.def(
      "coopmat_op_plan",
      [](int64_t m, int64_t n, int64_t k, int64_t batch, bool a_transposable) {
        if (m < 1 || n < 1 || k < 1 || batch < 1) throw py::value_error("m, n, k and batch must be positive");
        const CoopMatOpPlan p = coopmat_op_plan(m, n, k, batch, a_transposable);
        return py::make_tuple(p.tile ? std::string(p.tile->name) : std::string("off"), p.splits, p.transpose_a);
      },
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("batch") = 1, py::arg("a_transposable") = false,
      "The bfloat16/float16 matmul op's plan on a device with cooperative matrices for an M x N output "
      "(per batch matrix) and inner size K: (tiling, slices of K, whether a row-major A is transposed "
      "first), as RECURRA_VK_COOPMAT, RECURRA_VK_SPLITK and RECURRA_VK_TRANSPOSE leave it (no device "
      "needed). a_transposable: A is one row-major matrix the op can transpose.");
  m.def(
      "coopmat_matmul",
      [](const py::array_t<uint16_t, py::array::c_style>& a, const py::array_t<uint16_t, py::array::c_style>& b,
         const std::string& dtype, int reps, const std::string& variant, int device) {
        if (dtype != "bf16" && dtype != "f16") throw py::value_error("dtype must be 'bf16' or 'f16', got '" + dtype + "'");
        if (a.ndim() != 2 || b.ndim() != 2) throw py::value_error("a and b must be 2-D");
        if (a.shape(1) != b.shape(0))
          throw py::value_error("a is " + std::to_string(a.shape(0)) + "x" + std::to_string(a.shape(1)) + " and b " +
                                std::to_string(b.shape(0)) + "x" + std::to_string(b.shape(1)) +
                                ": the inner dimensions differ");
        const int64_t m = a.shape(0), k = a.shape(1), n = b.shape(1);
        py::array_t<float> c({m, n});
        double sec = 0.0;
        {
          const uint16_t* pa = a.data();
          const uint16_t* pb = b.data();
          float* pc = c.mutable_data();
          py::gil_scoped_release nogil;
          sec = coopmat_matmul(device, pa, pb, pc, m, n, k, dtype == "bf16", variant, reps);
        }
        return py::make_tuple(c, sec);
      },
      py::arg("a"), py::arg("b"), py::arg("dtype") = "bf16", py::arg("reps") = 1,
      py::arg("variant") = "cm128w4dp2rn", py::arg("device") = 0,
      "C (float32) = A @ B on the tensor cores: a (M, K) and b (K, N) uint16 arrays holding bf16 or f16 bits, "
      "M, N, K multiples of the variant's tile. Runs once untimed, then reps times; returns (c, GPU seconds of "
      "one run). NotImplementedError where the device or build lacks it.");
  m.def("shutdown", [] { backend_table()->shutdown(nullptr); },
        "Releases every device; the backend cannot be used afterwards.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.status) {
        case RECURRA_ERR_INVALID: PyErr_SetString(PyExc_ValueError, e.what()); break;
        case RECURRA_ERR_OOM: PyErr_SetString(PyExc_MemoryError, e.what()); break;
        case RECURRA_ERR_UNSUPPORTED: PyErr_SetString(PyExc_NotImplementedError, e.what()); break;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
      }
    }
  });
}
