// The Python binding of the native core (module recurra._core). C++ exceptions become
// Python ones here: ValueError, TypeError, MemoryError, RuntimeError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <new>

#include "blas.h"
#include "graph.h"
#include "memory.h"
#include "profile.h"
#include "threadpool.h"

namespace py = pybind11;
using namespace recurra;

namespace {

DType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "f32") return DType::f32;
  if (s == "int32" || s == "i32") return DType::i32;
  if (s == "bfloat16" || s == "bf16") return DType::bf16;
  if (s == "float16" || s == "f16") return DType::f16;
  throw TypeError("unsupported dtype '" + s + "': recurra tensors are float32, bfloat16, float16 or int32");
}

// numpy's dtype for t; bfloat16 is ml_dtypes' (a dependency of recurra-core).
py::dtype np_dtype(DType t) {
  switch (t) {
    case DType::i32: return py::dtype::of<int32_t>();
    case DType::bf16: return py::dtype::from_args(py::module_::import("ml_dtypes").attr("bfloat16"));
    case DType::f16: return py::dtype("float16");
    default: return py::dtype::of<float>();
  }
}

// A Graph plus the Python objects whose memory its leaves point into.
class PyGraph {
 public:
  Graph g;
  std::vector<py::object> keep;  // per node: the object backing a bound leaf

  int leaf(const std::string& dtype, const std::vector<int64_t>& shape, uint32_t flags,
           const std::string& name) {
    int id = g.leaf(parse_dtype(dtype), Shape::from(shape), flags, name);
    keep.resize(g.size());
    return id;
  }

  int op(const std::string& name, const std::vector<int>& src, const std::vector<int64_t>& ip,
         const std::vector<double>& fp) {
    int id = g.op(name, src, ip, fp);
    keep.resize(g.size());
    return id;
  }

  // Binds a leaf to the memory of a C-contiguous numpy array (or any buffer) of the same
  // dtype and element count. The graph keeps the object alive.
  void bind(int id, py::buffer obj) {
    Node& n = g.node(id);
    if (!n.is_leaf()) throw ValueError("set_data: node " + std::to_string(id) + " is not a leaf");
    py::buffer_info info = obj.request();
    const bool is_f32 = info.format == py::format_descriptor<float>::format();
    const bool is_i32 = info.itemsize == 4 && (info.format == "i" || info.format == "l" || info.format == "=i");
    // bfloat16 and float16 arrive as their 2-byte patterns (numpy float16 or uint16: a
    // buffer of ml_dtypes' bfloat16 has no format Python's buffer protocol knows).
    const bool is_16 = info.itemsize == 2 && (info.format == "e" || info.format == "H" || info.format == "=H");
    if ((n.dtype == DType::f32 && !is_f32) || (n.dtype == DType::i32 && !is_i32) || (is_half(n.dtype) && !is_16))
      throw TypeError("set_data: leaf " + std::to_string(id) + " is " + dtype_name(n.dtype) +
                      ", got buffer of format '" + info.format + "'");
    if (info.size != n.numel())
      throw ValueError("set_data: leaf " + std::to_string(id) + " has shape " + n.shape.str() +
                       " (" + std::to_string(n.numel()) + " elements), got " + std::to_string(info.size));
    int64_t expect = info.itemsize;
    for (int i = static_cast<int>(info.ndim) - 1; i >= 0; --i) {
      if (info.shape[i] != 1 && info.strides[i] != expect)
        throw ValueError("set_data: the buffer must be C-contiguous");
      expect *= info.shape[i];
    }
    g.bind(id, info.ptr);
    keep.resize(g.size());
    keep[id] = obj;
  }

  void bind_device(int id, std::shared_ptr<DeviceBuffer> buf) {
    g.bind_device(id, std::move(buf));
    keep.resize(g.size());
    keep[id] = py::none();
  }

  // A fresh array holding the node's value. Large ones live in recurra's host memory
  // (persistent pool): results of the same size step after step then reuse kept blocks
  // instead of fresh pages (see host_alloc); small ones (a loss) are plain numpy arrays.
  py::array read(int id) {
    const Node& n = g.node(id);
    if (n.nbytes() < (size_t{1} << 20)) {
      py::array out(np_dtype(n.dtype), shape_of(n));
      g.read(id, out.mutable_data());
      return out;
    }
    auto buf = std::make_shared<HostBuffer>(std::max<size_t>(n.nbytes(), 1), Pool::persistent);
    g.read(id, buf->data());
    return wrap(n, std::move(buf));
  }

  // The node's value as an array: a node computed on the CPU with memory of its own
  // (kOwnMemory) hands that memory over (no copy; the graph holds none until the next
  // compute); any other node is read() (a copy).
  py::array take(int id) {
    auto buf = g.take_host(id);
    return buf ? wrap(g.node(id), std::move(buf)) : read(id);
  }

  void unbind(int id) {
    g.unbind(id);
    keep.resize(g.size());
    keep[id] = py::none();
  }

 private:
  static std::vector<py::ssize_t> shape_of(const Node& n) {
    return std::vector<py::ssize_t>(n.shape.d, n.shape.d + n.shape.ndim);
  }
  // An array of node n's shape and dtype over `buf` (dense), which it keeps alive.
  static py::array wrap(const Node& n, std::shared_ptr<HostBuffer> buf) {
    void* data = buf->data();
    auto* owner = new std::shared_ptr<HostBuffer>(std::move(buf));
    py::capsule base(owner, [](void* p) { delete static_cast<std::shared_ptr<HostBuffer>*>(p); });
    return py::array(np_dtype(n.dtype), shape_of(n), data, base);
  }

 public:

  py::dict info(int id) {
    const Node& n = g.node(id);
    py::dict d;
    d["shape"] = py::tuple(py::cast(n.shape.vec()));
    d["dtype"] = dtype_name(n.dtype);
    d["op"] = n.is_leaf() ? std::string("leaf") : OpTable::get().at(n.op).name;
    d["src"] = n.src;
    d["flags"] = n.flags;
    d["grad"] = n.grad;
    d["is_view"] = n.is_view();
    d["name"] = n.name;
    d["segment"] = n.segment;
    return d;
  }
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "recurra's native core: graphs, ops, autodiff, the CPU backend.";

  static py::exception<StateError> state_error(m, "StateError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const StateError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "recurra: out of host memory; " RECURRA_OOM_HINT);
    }
  });

  m.attr("FLAG_PARAM") = static_cast<uint32_t>(kParam);
  m.attr("FLAG_INPUT") = static_cast<uint32_t>(kInput);
  m.attr("FLAG_OUTPUT") = static_cast<uint32_t>(kOutput);
  m.attr("FLAG_LOSS") = static_cast<uint32_t>(kLoss);
  m.attr("FLAG_CONST") = static_cast<uint32_t>(kConst);
  m.attr("FLAG_OWN_MEMORY") = static_cast<uint32_t>(kOwnMemory);

  py::class_<PyGraph>(m, "Graph")
      .def(py::init<>())
      .def("leaf", &PyGraph::leaf, py::arg("dtype"), py::arg("shape"), py::arg("flags") = 0,
           py::arg("name") = "")
      .def("op", &PyGraph::op, py::arg("name"), py::arg("src"), py::arg("ip") = std::vector<int64_t>{},
           py::arg("fp") = std::vector<double>{})
      .def("set_flags", [](PyGraph& s, int id, uint32_t flags) { s.g.node(id).flags |= flags; })
      .def("set_segment", [](PyGraph& s, int seg) { s.g.set_segment(seg); }, py::arg("segment"),
           "The recomputation segment of the op nodes built from now on (0: none).")
      .def("segment", [](PyGraph& s) { return s.g.segment(); })
      .def("build_backward", [](PyGraph& s, int loss, int seed) {
             s.g.build_backward(loss, seed);
             s.keep.resize(s.g.size());
           }, py::arg("loss"), py::arg("seed") = -1)
      .def("grad", [](PyGraph& s, int id) { return s.g.node(id).grad; })
      .def("plan", [](PyGraph& s) {
        const MemoryPlan& p = s.g.plan();
        py::dict d;
        d["arena_bytes"] = p.arena_bytes;
        d["unplanned_bytes"] = p.unplanned_bytes;
        d["n_planned"] = p.n_planned;
        d["peak_live_bytes"] = p.peak_live_bytes;
        d["own_bytes"] = p.own_bytes;
        d["n_in_place"] = p.n_in_place;
        d["in_place_bytes"] = p.in_place_bytes;
        d["n_redirected"] = p.n_redirected;
        d["n_folded_casts"] = p.n_folded_casts;
        d["n_widened_products"] = p.n_widened_products;
        py::list at_peak;  // (op, bytes) live at the peak, largest first
        for (const auto& [op, bytes] : p.live_at_peak) at_peak.append(py::make_tuple(op, bytes));
        d["live_at_peak"] = at_peak;
        py::list nodes_at_peak;  // (id, op, dtype, shape, bytes, in the forward) of each
        int n_fwd = s.g.size();  // nodes up to the loss: the forward
        for (int i = 0; i < s.g.size(); ++i)
          if (s.g.node(i).flags & kLoss) {
            n_fwd = i + 1;
            break;
          }
        for (int id : p.live_nodes_at_peak) {
          const Node& n = s.g.node(id);
          nodes_at_peak.append(py::make_tuple(id, OpTable::get().at(n.op).name, dtype_name(n.dtype),
                                              py::tuple(py::cast(n.shape.vec())), n.nbytes(), id < n_fwd));
        }
        d["live_nodes_at_peak"] = nodes_at_peak;
        d["peak_node"] = p.peak_node;
        py::dict segs;  // backend -> bytes of each arena segment
        for (const auto& [b, bytes] : s.g.placement().segment_bytes) segs[py::str(backend_name(b))] = bytes;
        d["segments"] = segs;
        return d;
      })
      .def("bind", &PyGraph::bind)
      .def("compute", [](PyGraph& s) {
        py::gil_scoped_release nogil;
        s.g.compute();
      })
      .def(
          "compute_reporting",
          [](PyGraph& s, const std::vector<std::vector<int>>& groups, py::function ready,
             const std::vector<std::shared_ptr<DeviceBuffer>>& targets) {
            // ready(k) runs with the GIL; an exception it raises stops the computation and
            // is raised here, as it was.
            struct Stop {};
            std::unique_ptr<py::error_already_set> err;
            auto call = [&](int k) {
              py::gil_scoped_acquire gil;
              try {
                ready(k);
              } catch (py::error_already_set& e) {
                err = std::make_unique<py::error_already_set>(std::move(e));
                throw Stop{};
              }
            };
            try {
              py::gil_scoped_release nogil;
              s.g.compute(groups, call, targets);
            } catch (Stop&) {
              throw std::move(*err);
            }
          },
          py::arg("groups"), py::arg("ready"), py::arg("targets") = std::vector<std::shared_ptr<DeviceBuffer>>{},
          "compute(), calling ready(k) as soon as every node of groups[k] holds its final "
          "value while the rest still runs (a device split is cut there). targets[k] (a "
          "host-visible DeviceBuffer or None; asynchronous reads only): group k's values are "
          "copied there on the device, packed in the group's order, so that read_packed(groups[k], "
          "its memory) copies nothing.")
      .def("read", &PyGraph::read)
      .def(
          "read_into",
          [](PyGraph& s, int id, py::array out) {
            const Node& n = s.g.node(id);
            if (!(out.flags() & py::array::c_style) || !out.writeable() ||
                static_cast<size_t>(out.nbytes()) != n.nbytes() ||
                out.dtype().itemsize() != static_cast<py::ssize_t>(dtype_size(n.dtype)))
              throw ValueError("read_into: node " + std::to_string(id) + " needs a writable C-contiguous array of " +
                               std::to_string(n.numel()) + " elements of " + std::to_string(dtype_size(n.dtype)) +
                               " bytes");
            void* dst = out.mutable_data();
            py::gil_scoped_release nogil;
            s.g.read(id, dst);
          },
          py::arg("id"), py::arg("out"), "Copies node id's value into `out` (read() without a new array).")
      .def(
          "read_packed",
          [](PyGraph& s, const std::vector<int>& ids, py::array out) {
            size_t bytes = 0;
            for (int id : ids) bytes += s.g.node(id).nbytes();
            if (!(out.flags() & py::array::c_style) || !out.writeable() || static_cast<size_t>(out.nbytes()) != bytes)
              throw ValueError("read_packed: the nodes need a writable C-contiguous array of " + std::to_string(bytes) +
                               " bytes");
            void* dst = out.mutable_data();
            py::gil_scoped_release nogil;
            s.g.read_packed(ids, dst);
          },
          py::arg("ids"), py::arg("out"),
          "The values of `ids` one after the other into `out` (those on a device packed there: one "
          "download per device).")
      .def("take", &PyGraph::take, py::arg("id"),
           "The value of a node after compute: handed over (no copy) when the node has memory "
           "of its own on the CPU (FLAG_OWN_MEMORY), else a copy as read().")
      .def("unbind", &PyGraph::unbind, py::arg("id"),
           "Lets go of a leaf's memory; the plan stays (bind memory of the same backend again).")
      .def("bind_device", &PyGraph::bind_device)
      .def("set_backends", [](PyGraph& s, const std::vector<std::string>& names, bool strict) {
             std::vector<int> ids;
             for (const auto& nm : names) {
               int b = find_backend(nm);
               if (b < 0) throw ValueError("unknown or unavailable backend '" + nm + "'");
               ids.push_back(b);
             }
             s.g.set_backends(ids, strict);
           }, py::arg("names"), py::arg("strict") = false)
      .def("backend_of", [](PyGraph& s, int id) { return backend_name(s.g.backend_of(id)); })
      .def("n_splits", [](PyGraph& s) { return s.g.n_splits(); })
      .def("splits", [](PyGraph& s) {
        py::list out;
        for (const auto& sp : s.g.placement().splits)
          out.append(py::make_tuple(backend_name(sp.backend), sp.nodes.size(), sp.mirrors.size()));
        return out;
      })
      .def("copy_to_device_buffer", [](PyGraph& s, int id) { return s.g.copy_to_device_buffer(id); })
      .def("copy_to_device_buffers",
           [](PyGraph& s, const std::vector<int>& ids) {
             py::gil_scoped_release nogil;
             return s.g.copy_to_device_buffers(ids);
           })
      .def("take_buffers",
           [](PyGraph& s, const std::vector<int>& ids) {
             py::gil_scoped_release nogil;
             return s.g.take_buffers(ids);
           },
           "As copy_to_device_buffers, but a node with memory of its own hands its buffer "
           "over instead of a copy (the graph holds none until the next compute).")
      .def("owns_memory", [](PyGraph& s, int id) {
             s.g.plan();
             return s.g.owns_memory(id);
           })
      .def("info", &PyGraph::info)
      .def("__len__", [](PyGraph& s) { return s.g.size(); });

  py::class_<HostBuffer, std::shared_ptr<HostBuffer>>(m, "HostBuffer", py::buffer_protocol())
      .def(py::init([](size_t nbytes, const std::string& pool) {
             Pool p = pool == "transient" ? Pool::transient : Pool::persistent;
             return std::make_shared<HostBuffer>(nbytes, p);
           }), py::arg("nbytes"), py::arg("pool") = "persistent")
      .def_property_readonly("nbytes", &HostBuffer::nbytes)
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      });

  // Shape inference without running anything: the lazy tensor API calls it per op so
  // errors surface where the op is written, not when the graph runs.
  m.def("infer", [](const std::string& name, const std::vector<std::pair<std::string, std::vector<int64_t>>>& srcs,
                    const std::vector<int64_t>& ip, const std::vector<double>& fp) {
    Graph g;
    std::vector<int> ids;
    for (const auto& [dt, shape] : srcs) ids.push_back(g.leaf(parse_dtype(dt), Shape::from(shape)));
    const Node& n = g.node(g.op(name, ids, ip, fp));
    return py::make_tuple(dtype_name(n.dtype), py::tuple(py::cast(n.shape.vec())));
  });
  py::class_<DeviceBuffer, std::shared_ptr<DeviceBuffer>>(m, "DeviceBuffer")
      .def(py::init([](const std::string& backend, size_t nbytes, const std::string& pool) {
             int b = find_backend(backend);
             if (b <= 0) throw ValueError("unknown or unavailable device backend '" + backend + "'");
             if (pool == "host") return std::make_shared<DeviceBuffer>(b, nbytes, DeviceBuffer::HostVisible{});
             if (pool != "transient" && pool != "persistent")
               throw ValueError("DeviceBuffer: pool is 'persistent', 'transient' or 'host', not '" + pool + "'");
             return std::make_shared<DeviceBuffer>(b, nbytes, pool == "transient" ? Pool::transient : Pool::persistent);
           }), py::arg("backend"), py::arg("nbytes"), py::arg("pool") = "persistent",
           "Memory on a device backend; pool='host': host-visible memory (where the backend has "
           "asynchronous reads) that the host reads and writes through host_array().")
      .def_static(
          "import_host",
          [](const std::string& backend, py::buffer obj) {
            int b = find_backend(backend);
            if (b <= 0) throw ValueError("unknown or unavailable device backend '" + backend + "'");
            py::buffer_info info = obj.request(true);
            if (info.ndim != 1 || info.strides[0] != info.itemsize)
              throw ValueError("import_host: the memory must be one contiguous run of bytes");
            return std::make_shared<DeviceBuffer>(b, info.ptr, static_cast<size_t>(info.size * info.itemsize),
                                                  DeviceBuffer::Imported{});
          },
          py::arg("backend"), py::arg("memory"), py::keep_alive<0, 2>(),
          "A host-visible buffer over ``memory`` (a writable, contiguous buffer whose address and "
          "size are multiples of the device's import alignment, a page): the device reads and "
          "writes that memory itself (where it can import host memory: _core.can_import_host; "
          "ValueError where it refuses this memory). The buffer keeps ``memory`` referenced; it "
          "must stay mapped while the buffer lives.")
      .def_property_readonly("host_visible", [](const DeviceBuffer& b) { return b.host() != nullptr; })
      .def(
          "host_array",
          [](std::shared_ptr<DeviceBuffer> b) {
            uint8_t* p = b->host();
            if (!p) throw ValueError("host_array: this buffer is device memory (make it with pool='host')");
            // A uint8 view of the memory that keeps the buffer alive.
            return py::array(py::dtype::of<uint8_t>(), {static_cast<py::ssize_t>(b->nbytes())}, {1}, p,
                             py::cast(b));
          },
          "The buffer's bytes as a writable uint8 numpy array (host-visible buffers only; valid "
          "while the backend is open). A compute submitted after a host write reads it.")
      .def_property_readonly("nbytes", &DeviceBuffer::nbytes)
      .def_property_readonly("backend", [](const DeviceBuffer& b) { return backend_name(b.backend()); })
      .def_property_readonly("valid", &DeviceBuffer::valid)
      .def_property_readonly("handle", [](const DeviceBuffer& b) {
        return py::make_tuple(b.handle().handle, b.handle().generation);
      })
      .def("upload", [](DeviceBuffer& b, py::buffer obj, size_t offset) {
        py::buffer_info info = obj.request();
        py::gil_scoped_release nogil;  // the caller holds obj; other threads run meanwhile
        b.upload(offset, info.ptr, static_cast<size_t>(info.size * info.itemsize));
      }, py::arg("array"), py::arg("offset") = 0)
      .def("download", [](const DeviceBuffer& b, py::buffer obj, size_t offset) {
        py::buffer_info info = obj.request(true);
        py::gil_scoped_release nogil;
        b.download(offset, info.ptr, static_cast<size_t>(info.size * info.itemsize));
      }, py::arg("out"), py::arg("offset") = 0);

  m.def("register_backend", [](py::capsule cap) {
    if (std::string(cap.name() ? cap.name() : "") != "recurra.backend_table")
      throw ValueError("register_backend: expected a capsule named 'recurra.backend_table'");
    auto* t = static_cast<const recurra_backend_table*>(cap.get_pointer());
    std::vector<std::string> names;
    for (int id : register_backend(t)) names.push_back(backend_name(id));
    return names;
  });
  m.def("close_backend", [](const std::string& name, bool shutdown) {
    int b = find_backend(name);
    if (b <= 0) throw ValueError("unknown backend '" + name + "'");
    close_backend(b, shutdown);
  }, py::arg("name"), py::arg("shutdown") = false);
  m.def("backend_abi_version", [] { return RECURRA_BACKEND_ABI_VERSION; });
  m.def(
      "has_async_reads",
      [](const std::string& name) {
        const int b = find_backend(name);
        return b > 0 && has_async_reads(b);
      },
      py::arg("backend"),
      "Whether a device backend reads reported gradients asynchronously (Graph.compute_reporting) "
      "and offers host-visible buffers (DeviceBuffer(pool='host')).");
  m.def(
      "can_import_host",
      [](const std::string& name) {
        const int b = find_backend(name);
        return b > 0 && can_import_host(b);
      },
      py::arg("backend"),
      "Whether a device backend may import host memory (DeviceBuffer.import_host); the device may "
      "still refuse a given range.");
  m.def("transfer_stats", [] {
    TransferStats t = transfer_stats();
    py::dict d;
    d["host_to_device"] = py::dict(py::arg("count") = t.h2d_count, py::arg("bytes") = t.h2d_bytes);
    d["device_to_host"] = py::dict(py::arg("count") = t.d2h_count, py::arg("bytes") = t.d2h_bytes);
    return d;
  });
  m.def("reset_transfer_stats", &transfer_stats_reset);
  m.def("profile_enable", &profile_enable, py::arg("on"), py::arg("by_shape") = false);
  m.def("profile_enabled", &profile_enabled);
  m.def("profile_stats", [] {
    py::list out;
    for (const ProfileEntry& e : profile_snapshot()) out.append(py::make_tuple(e.key, e.calls, e.ns));
    return out;
  });
  m.def("profile_reset", &profile_reset);
  m.def("set_num_threads", [](int n) {
    py::gil_scoped_release nogil;  // it waits for computations in other threads
    return set_num_threads(n);
  }, py::arg("n"));
  m.def("default_num_threads", &default_num_threads);
  m.def("get_num_threads", &get_num_threads);
  m.def("op_names", [] {
    std::vector<std::string> names;
    const OpTable& t = OpTable::get();
    for (int i = 0; i < t.size(); ++i) names.push_back(t.at(i).name);
    return names;
  });
  m.def("op_spec", [] {
    // recurra/op_spec.h as Python data (recurra.ops.spec() wraps it read-only).
    int32_t n = 0;
    const recurra_op_spec* t = recurra_op_specs(&n);
    py::list out;
    for (int32_t i = 0; i < n; ++i) {
      py::dict e;
      e["name"] = t[i].name;
      e["srcs"] = py::make_tuple(t[i].src_min, t[i].src_max);
      e["n_ip"] = py::make_tuple(t[i].ip_min, t[i].ip_max);
      e["n_fp"] = py::make_tuple(t[i].fp_min, t[i].fp_max);
      e["unary"] = t[i].unary;
      e["sources"] = t[i].srcs;
      e["ip"] = t[i].ip;
      e["fp"] = t[i].fp;
      e["output"] = t[i].output;
      e["backward"] = t[i].backward;
      e["decomposition"] = t[i].decomposition;
      // RECURRA_OPS_HALF: the float dtypes the op takes
      if (recurra_op_takes_half(t[i].name))
        e["dtypes"] = py::make_tuple("float32", "bfloat16", "float16");
      else
        e["dtypes"] = py::make_tuple("float32");
      e["reads_half"] = recurra_op_takes_half_in(t[i].name) != 0;  // RECURRA_OPS_HALF_IN
      e["autocast"] = recurra_op_autocast(t[i].name);  // RECURRA_AUTOCAST_*
      out.append(e);
    }
    return out;
  });
  m.def("set_recompute_casts", &set_recompute_casts, py::arg("on"),
        "Whether backward graphs built from now on recompute casts for the rules that read "
        "them (widening casts and casts of leaves; on by default) instead of keeping them.");
  m.def("recompute_casts", &recompute_casts);
  m.def("set_cpu_refused_ops", &set_cpu_refused_ops, py::arg("names"),
        "For tests: the CPU kernels of these ops refuse every node, so graphs built from now "
        "on use their decompositions (recurra/op_spec.h); [] restores them.");
  m.def("op_codes", [] {
    // The named codes of recurra/op_spec.h that Python packs into parameters and sources
    // (the unary codes are each unary op's "unary" in op_spec()).
    py::dict d;
#define RC_CODE(name) d[#name] = static_cast<int64_t>(RECURRA_##name)
    RC_CODE(SSM_SCAN_SAVE_CHECKPOINTS);
    RC_CODE(SSM_SCAN_CHECKPOINTS_AUTO);
    RC_CODE(SSM_SCAN_STATE_IN_PLACE);
    RC_CODE(HYPER_LR);
    RC_CODE(HYPER_GRAD_SCALE);
    RC_CODE(HYPER_CLIP_VALUE);
    RC_CODE(HYPER_MAX_NORM);
    RC_CODE(HYPER_WEIGHT_DECAY);
    RC_CODE(HYPER_A);
    RC_CODE(HYPER_B);
    RC_CODE(HYPER_C);
    RC_CODE(HYPER_MAXIMIZE);
    RC_CODE(HYPER_SLOTS);
    RC_CODE(UNARY_COUNT);
#undef RC_CODE
    return d;
  });
  m.def("memory_stats", [] {
    py::dict d;
    for (auto [name, pool] : {std::pair{"persistent", Pool::persistent}, std::pair{"transient", Pool::transient}}) {
      PoolStats s = memory_stats(pool);
      py::dict e;
      e["bytes"] = s.bytes;
      e["peak_bytes"] = s.peak_bytes;
      e["n_allocs"] = s.n_allocs;
      d[name] = e;
    }
    py::dict c;
    c["bytes"] = static_cast<int64_t>(host_cache_bytes());
    d["host_cache"] = c;
    return d;
  });
  m.def("reset_peak_memory", &memory_stats_reset_peak);
  m.def("empty_cache", &host_cache_clear, "Frees the large host blocks kept for reuse.");
  m.def("load_blas", &load_blas, py::arg("path"),
        "Loads an OpenBLAS shared library for matmul; returns False when it cannot be used.");
  m.def("blas_name", &blas_name);
}
