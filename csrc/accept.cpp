// Derived from the contract in eagle3_ops/validation.py and held equal to it by tests/ops/test_accept.py.
//
// The eager faces' fast acceptance in C++: the same sufficient conditions of the ops' contract as
// eagle3_ops/accept.py (the Python twin, which serves where this module is not built), at a fraction
// of the cost (no Python attribute lookups, no tuple per view). Each function returns "accepted" only
// when the full check in eagle3_ops/validation.py would pass with the same arguments; anything it is
// not sure of returns "not accepted" and the face runs the full check, which raises with its message
// or passes. tests/ops/test_accept.py holds both twins to that over generated arguments.
//
// Each also answers "not accepted" while a Python dispatch mode (FakeTensorMode, make_fx's proxy mode,
// ...), a torch-function mode or a torch.func transform is active: "accepted" means the face may run
// the op's implementation itself. Only torch.compile's tracing is left to the face, which asks
// torch.compiler.is_compiling() first (dynamo folds that call; it never reaches these functions).
// They are plain METH_FASTCALL functions, not pybind11 ones: pybind11's argument dispatch cost more
// than the checks themselves (~2 000 instructions a call for draft_fc's ten arguments).
//
// Accepted tensors: torch.Tensor, nn.Parameter and its plain subclasses (plain_object), strided, dense CPU or CUDA (no Python, functionalization,
// functorch, sparse, mkldnn, meta or quantized key), not requiring grad, non-empty, with storage.
// Two views are apart when their byte ranges [address, address + extent) are disjoint. Shapes and
// strides are read from the tensor itself: a Python attribute shadowing a tensor method (an instance's
// `dim`, a subclass's `shape` property) fools the Python checks, not this one, and the backend reads
// the tensor itself too.
#include <Python.h>

// Not torch/extension.h (the whole C++ frontend): it tripled this file's compile time.
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <initializer_list>
#include <utility>

namespace eagle3 {
namespace {

using Span = std::pair<uintptr_t, uintptr_t>;  // [lo, hi) bytes

// The dispatch keys a plain dense CPU / CUDA tensor carries.
const c10::DispatchKeySet& plain_keys() {
  static const c10::DispatchKeySet keys({c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCPU,
                                         c10::DispatchKey::AutogradCUDA, c10::DispatchKey::ADInplaceOrView,
                                         c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});
  return keys;
}

bool is_served_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

// The tensor behind `obj` when it is a plain tensor (see the file comment) on `device` (any CPU or
// CUDA device when null) in `dtype` (any when Undefined); nullptr otherwise.
// `obj.name is owner.name`, reading both as Python does (instance dict, __getattribute__, MRO).
bool same_attribute(PyObject* obj, PyObject* owner, PyObject* name) {
  PyObject* a = PyObject_GetAttr(obj, name);
  PyObject* b = a != nullptr ? PyObject_GetAttr(owner, name) : nullptr;
  const bool same = a != nullptr && b != nullptr && a == b;
  Py_XDECREF(a);
  Py_XDECREF(b);
  if (!same) PyErr_Clear();
  return same;
}

// Whether `obj` behaves as a torch.Tensor in eager: exactly torch.Tensor or nn.Parameter (torch itself
// looks no further for those), or an instance of a subclass of nn.Parameter (SGLang's
// BasevLLMParameter family) of the same metaclass whose __torch_function__ and __torch_dispatch__,
// read from the object as torch's own override check reads them, are nn.Parameter's and
// torch.Tensor's (so an override assigned later, to the class or the instance, is seen).
bool plain_object(PyObject* obj) {
  PyTypeObject* tp = Py_TYPE(obj);
  if (THPVariable_CheckTypeExact(tp)) return true;
  auto* param = reinterpret_cast<PyTypeObject*>(ParameterClass);
  if (param == nullptr || Py_TYPE(tp) != Py_TYPE(param) || !PyType_IsSubtype(tp, param)) return false;
  static PyObject* const tf = PyUnicode_InternFromString("__torch_function__");
  static PyObject* const td = PyUnicode_InternFromString("__torch_dispatch__");
  return same_attribute(obj, ParameterClass, tf) && same_attribute(obj, THPVariableClass, td);
}

const at::Tensor* plain(PyObject* obj, const c10::Device* device, at::ScalarType dtype) {
  if (!plain_object(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return nullptr;
  if (!plain_keys().isSupersetOf(t.key_set())) return nullptr;  // (operator- keeps backend bits)
  if (t.requires_grad()) return nullptr;
  if (dtype != at::ScalarType::Undefined && t.scalar_type() != dtype) return nullptr;
  if (device != nullptr ? t.device() != *device : !(t.is_cpu() || t.is_cuda())) return nullptr;
  if (t.data_ptr() == nullptr) return nullptr;
  return &t;
}

// [p, p + elements * es) does not wrap around the address space (the ranges compared below are then
// true byte ranges; Python's integers cannot wrap, this arithmetic could).
bool fits_in_address_space(uintptr_t p, int64_t elements, int64_t es) {
  uintptr_t bytes = 0, end = 0;
  return elements >= 0 && !__builtin_mul_overflow(static_cast<uintptr_t>(elements), static_cast<uintptr_t>(es), &bytes) &&
         !__builtin_add_overflow(p, bytes, &end);
}

struct Matrix {
  int64_t rows, cols, stride;
  uintptr_t p;
  int64_t es;
  // bytes from the first element to one past the last
  uintptr_t end() const { return p + static_cast<uintptr_t>(((rows - 1) * stride + cols) * es); }
};

// A plain, non-empty 2-D view with unit last stride.
std::optional<Matrix> matrix(PyObject* obj, const c10::Device& device, at::ScalarType dtype) {
  const at::Tensor* t = plain(obj, &device, dtype);
  if (t == nullptr || t->dim() != 2) return std::nullopt;
  const auto sizes = t->sizes();
  const auto strides = t->strides();
  if (sizes[0] == 0 || sizes[1] == 0 || strides[1] != 1 || strides[0] < 0) return std::nullopt;
  const Matrix m{sizes[0], sizes[1], strides[0], reinterpret_cast<uintptr_t>(t->data_ptr()), t->element_size()};
  if (!fits_in_address_space(m.p, (m.rows - 1) * m.stride + m.cols, m.es)) return std::nullopt;
  return m;
}

struct Flat {
  int64_t n;
  uintptr_t p;
  int64_t es;
  const at::Tensor* t;
  Span span() const { return {p, p + static_cast<uintptr_t>(n * es)}; }
};

// A plain, non-empty 1-D view with unit stride, its dtype one of `dtypes`.
std::optional<Flat> flat(PyObject* obj, const c10::Device& device, std::initializer_list<at::ScalarType> dtypes) {
  const at::Tensor* t = plain(obj, &device, at::ScalarType::Undefined);
  if (t == nullptr || t->dim() != 1 || t->size(0) == 0 || t->stride(0) != 1) return std::nullopt;
  bool ok = false;
  for (auto d : dtypes) ok = ok || t->scalar_type() == d;
  if (!ok) return std::nullopt;
  const Flat f{t->size(0), reinterpret_cast<uintptr_t>(t->data_ptr()), t->element_size(), t};
  if (!fits_in_address_space(f.p, f.n, f.es)) return std::nullopt;
  return f;
}

bool overlap(const Span& a, const Span& b) { return a.first < b.second && b.first < a.second; }

// A few byte ranges, without a heap allocation (a call has at most 6 read and 2 written ones).
struct Spans {
  Span v[8];
  size_t n = 0;
  Spans() = default;
  Spans(std::initializer_list<Span> spans) {
    for (const Span& s : spans) push_back(s);
  }
  void push_back(const Span& s) { v[n++] = s; }
  size_t size() const { return n; }
  const Span& operator[](size_t i) const { return v[i]; }
  const Span* begin() const { return v; }
  const Span* end() const { return v + n; }
};

// Every written range disjoint from every read range and from the other written ones.
bool apart(const Spans& writes, const Spans& reads) {
  for (size_t i = 0; i < writes.size(); ++i) {
    for (const auto& r : reads)
      if (overlap(writes[i], r)) return false;
    for (size_t j = i + 1; j < writes.size(); ++j)
      if (overlap(writes[i], writes[j])) return false;
  }
  return true;
}

template <typename I>
bool in_range(const I* r, int64_t n, int64_t R) {
  for (int64_t k = 0; k < n; ++k)
    if (r[k] < 0 || r[k] >= R) return false;
  return true;
}

// `type(v) is int` and its value, or nullopt (bool, other types, out of int64 range).
std::optional<int64_t> exact_int(PyObject* v) {
  if (!PyLong_CheckExact(v)) return std::nullopt;
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0 || (x == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return std::nullopt;
  }
  return static_cast<int64_t>(x);
}

// `type(v) is float` with 0 < v < inf.
bool good_eps(PyObject* v) {
  if (!PyFloat_CheckExact(v)) return false;
  const double e = PyFloat_AS_DOUBLE(v);
  return e > 0.0 && e < HUGE_VAL;
}

bool capture_accepted(py::handle hidden, py::handle residual, py::handle buffer, py::handle slot_obj) {
  const auto slot = exact_int(slot_obj.ptr());
  if (!slot) return false;
  const at::Tensor* h = plain(hidden.ptr(), nullptr, at::ScalarType::Undefined);
  if (h == nullptr || !is_served_dtype(h->scalar_type())) return false;
  const c10::Device device = h->device();
  const auto dtype = h->scalar_type();
  const auto m = matrix(hidden.ptr(), device, dtype);
  const auto b = matrix(buffer.ptr(), device, dtype);
  if (!m || !b) return false;
  const int64_t T = m->rows, H = m->cols, W = b->cols;
  if (W % H != 0 || *slot < 0 || *slot >= W / H || b->rows < T || (T > 1 && b->stride < W)) return false;
  const uintptr_t lo = b->p + static_cast<uintptr_t>(*slot * H * m->es);
  const Span slot_span{lo, lo + static_cast<uintptr_t>(((T - 1) * b->stride + H) * m->es)};
  if (overlap(slot_span, {m->p, m->end()})) return false;
  if (residual.is_none()) return true;
  const auto r = matrix(residual.ptr(), device, dtype);
  if (!r || r->rows != T || r->cols != H) return false;
  return !overlap(slot_span, {r->p, r->end()});
}

bool fused_add_rmsnorm_capture_accepted(py::handle input, py::handle residual, py::handle weight, py::handle eps,
                                        py::handle buffer, py::handle slot_obj) {
  const auto slot = exact_int(slot_obj.ptr());
  if (!slot || !good_eps(eps.ptr())) return false;
  const at::Tensor* x = plain(input.ptr(), nullptr, at::ScalarType::Undefined);
  if (x == nullptr || !is_served_dtype(x->scalar_type())) return false;
  const c10::Device device = x->device();
  const auto dtype = x->scalar_type();
  const auto m = matrix(input.ptr(), device, dtype);
  const auto r = matrix(residual.ptr(), device, dtype);
  const auto b = matrix(buffer.ptr(), device, dtype);
  if (!m || !r || !b) return false;
  const int64_t T = m->rows, H = m->cols, W = b->cols;
  const auto w = flat(weight.ptr(), device, {dtype});
  if (!w || w->n != H || r->rows != T || r->cols != H || W % H != 0 || *slot < 0 || *slot >= W / H || b->rows < T)
    return false;
  if (T > 1 && (m->stride < H || r->stride < H || b->stride < W)) return false;  // a written view must not overlap itself
  const uintptr_t s0 = b->p + static_cast<uintptr_t>(*slot * H * m->es);
  const Span slot_span{s0, s0 + static_cast<uintptr_t>(((T - 1) * b->stride + H) * m->es)};
  // input, residual and the buffer slot are written: apart from each other and from weight
  return apart({{m->p, m->end()}, {r->p, r->end()}, slot_span}, {w->span()});
}

// The output rows M (> 0) when accepted, else -1; host-side (CPU) rows are also range-checked here
// (out of range: -1, so the full path raises with its message). `out` None: the functional op.
int64_t draft_fc_accepted(py::handle x_obj, py::handle weight, py::handle bias, py::handle rows, py::handle cnw,
                          py::handle inw, py::handle eps, py::handle out, py::handle workspace,
                          py::handle norm_folded_obj) {
  if (!good_eps(eps.ptr()) || !PyBool_Check(norm_folded_obj.ptr())) return -1;
  const bool norm_folded = norm_folded_obj.ptr() == Py_True;
  const at::Tensor* xt = plain(x_obj.ptr(), nullptr, at::ScalarType::Undefined);
  if (xt == nullptr || !is_served_dtype(xt->scalar_type())) return -1;
  const c10::Device device = xt->device();
  const auto dtype = xt->scalar_type();
  const auto m = matrix(x_obj.ptr(), device, dtype);
  const auto w = matrix(weight.ptr(), device, dtype);
  if (!m || !w || w->cols != m->cols) return -1;
  const int64_t R = m->rows, KH = m->cols, N = w->rows, es = m->es;
  Spans reads{{m->p, m->end()}, {w->p, w->end()}};
  if (!bias.is_none()) {
    const auto b = flat(bias.ptr(), device, {dtype});
    if (!b || b->n != N) return -1;
    reads.push_back(b->span());
  }
  if (!cnw.is_none()) {
    const auto c = matrix(cnw.ptr(), device, dtype);
    if (!c || c->rows * c->cols != KH || (c->rows > 1 && c->stride != c->cols)) return -1;  // [K, hidden], contiguous
    reads.push_back({c->p, c->p + static_cast<uintptr_t>(KH * es)});
  }
  if (!inw.is_none()) {
    const auto i = flat(inw.ptr(), device, {dtype});
    if (!i || i->n != KH) return -1;
    reads.push_back(i->span());
  }
  if (norm_folded && ((cnw.is_none() && inw.is_none()) || (dtype == at::kHalf && !inw.is_none()))) return -1;
  int64_t M = R;
  if (!rows.is_none()) {
    const auto f = flat(rows.ptr(), device, {at::kInt, at::kLong});
    if (!f) return -1;
    M = f->n;
    reads.push_back(f->span());
    // host rows: in [0, R), or the full path says which are not
    if (device.is_cpu() && !(f->t->scalar_type() == at::kInt ? in_range(f->t->data_ptr<int32_t>(), M, R)
                                                              : in_range(f->t->data_ptr<int64_t>(), M, R)))
      return -1;
  }
  Spans writes;
  if (!out.is_none()) {
    const auto o = matrix(out.ptr(), device, dtype);
    if (!o || o->rows != M || o->cols != N || (M > 1 && o->stride < N)) return -1;
    writes.push_back({o->p, o->end()});
  }
  if (!workspace.is_none()) {
    const auto f = flat(workspace.ptr(), device, {at::kByte});
    if (!f || f->p % 16 != 0) return -1;  // the kernels' vector loads need 16-byte alignment
    writes.push_back(f->span());
  }
  return apart(writes, reads) ? M : -1;
}

// The eager state in which the face may run the implementation itself, read as torch reads it for
// torch._C._len_torch_dispatch_stack, _is_torch_function_mode_enabled and
// _are_functorch_transforms_active.
bool plain_eager_mode() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled()) return false;
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
         !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

PyObject* to_python(bool v) { return PyBool_FromLong(v); }
PyObject* to_python(int64_t v) { return PyLong_FromLongLong(v); }

// The Python entry of F (arguments positional, exactly N of them): F's answer in plain eager mode,
// else No. Not sure = not accepted: an exception from a tensor accessor (a layout without strides,
// ...) or a Python error met on the way means the full path decides, never an error raised from here.
template <typename R, R No, size_t... I, typename F>
PyObject* answer(F f, PyObject* const* args, std::index_sequence<I...>) {
  R r = No;
  try {
    if (plain_eager_mode()) r = f(py::handle(args[I])...);
  } catch (...) {
    r = No;
  }
  if (PyErr_Occurred() != nullptr) PyErr_Clear();
  return to_python(r);
}

template <auto F, typename R, R No, size_t N, const char* Name>
PyObject* fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != static_cast<Py_ssize_t>(N)) {
    PyErr_Format(PyExc_TypeError, "eagle3_ops._C.%s takes %zu positional arguments (%zd given)", Name, N, nargs);
    return nullptr;
  }
  return answer<R, No>(F, args, std::make_index_sequence<N>());
}

template <auto F, typename R, R No, size_t N, const char* Name>
PyMethodDef method(const char* doc) {
  return {Name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastcall<F, R, No, N, Name>)),
          METH_FASTCALL, doc};
}

constexpr char kAcceptCapture[] = "accept_capture";
constexpr char kAcceptFused[] = "accept_fused_add_rmsnorm_capture";
constexpr char kAcceptDraftFc[] = "accept_draft_fc";

// ---- the CUDA backend's draft_fc plan key (eagle3_ops/cuda_backend.py plan) -------------------------
// A plan is a pure function of what it reads of its six tensor arguments: per argument its presence,
// sizes, strides, dtype and 16-byte alignment, and weight's device. This packs exactly that into bytes
// (~0.1 us; the same tuple built in Python cost ~5 us per argument), or answers None where an argument
// is not a dense tensor this can read without Python (a fake or functional tensor, a layout without
// strides): the Python key then serves. Meta tensors (workspace sizing for a larger M) are read, their
// alignment decided by the storage offset as fc_rules.aligned16 decides it.
constexpr int kPlanKeyMaxDim = 4;

const c10::DispatchKeySet& readable_keys() {
  static const c10::DispatchKeySet keys =
      plain_keys() | c10::DispatchKeySet({c10::DispatchKey::Meta, c10::DispatchKey::AutogradMeta});
  return keys;
}

// Appends one argument's fields; false where it cannot be read here.
bool append_plan_fields(PyObject* obj, int64_t*& out) {
  if (obj == Py_None) {
    *out++ = -1;
    return true;
  }
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != at::kStrided || !readable_keys().isSupersetOf(t.key_set())) return false;
  const int64_t dim = t.dim();
  if (dim > kPlanKeyMaxDim) return false;
  const bool aligned = t.is_meta() ? (t.storage_offset() * static_cast<int64_t>(t.element_size())) % 16 == 0
                                   : reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  *out++ = dim;
  for (int64_t d = 0; d < dim; ++d) *out++ = t.size(d);
  for (int64_t d = 0; d < dim; ++d) *out++ = t.stride(d);
  *out++ = static_cast<int64_t>(t.scalar_type());
  *out++ = aligned;
  return true;
}

PyObject* draft_fc_plan_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_Format(PyExc_TypeError,
                 "eagle3_ops._C.draft_fc_plan_key takes 6 positional arguments (x, weight, bias, rows, "
                 "chunk_norm_weight, input_norm_weight), %zd given",
                 nargs);
    return nullptr;
  }
  if (args[1] == Py_None) Py_RETURN_NONE;  // no weight: not a call a plan is made for
  int64_t fields[6 * (3 + 2 * kPlanKeyMaxDim) + 2];
  int64_t* out = fields;
  try {
    for (Py_ssize_t i = 0; i < 6; ++i)
      if (!append_plan_fields(args[i], out)) Py_RETURN_NONE;
    const c10::Device device = THPVariable_Unpack(args[1]).device();  // weight: a tensor (read above)
    *out++ = static_cast<int64_t>(device.type());
    *out++ = device.index();
  } catch (...) {
    if (PyErr_Occurred() != nullptr) PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(fields),
                                   static_cast<Py_ssize_t>((out - fields) * sizeof(int64_t)));
}

}  // namespace

void bind_accept(py::module_& m) {
  static PyMethodDef methods[] = {
      method<capture_accepted, bool, false, 4, kAcceptCapture>(
          "eagle3_ops.accept.capture_accepted in C++ (hidden, residual, buffer, slot)"),
      method<fused_add_rmsnorm_capture_accepted, bool, false, 6, kAcceptFused>(
          "eagle3_ops.accept.fused_add_rmsnorm_capture_accepted in C++ (input, residual, weight, eps, buffer, slot)"),
      method<draft_fc_accepted, int64_t, int64_t{-1}, 10, kAcceptDraftFc>(
          "eagle3_ops.accept.draft_fc_accepted in C++ (x, weight, bias, rows, chunk_norm_weight, input_norm_weight, "
          "eps, out, workspace, norm_folded; host rows range-checked)"),
      {"draft_fc_plan_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&draft_fc_plan_key)),
       METH_FASTCALL,
       "The CUDA backend's draft_fc plan key (x, weight, bias, rows, chunk_norm_weight, input_norm_weight): "
       "bytes, or None where the Python key must serve"},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), methods) != 0) throw py::error_already_set();
  // What these functions answer for (eagle3_ops.accept.ACCEPT_VERSION): 2 = the eager state too (the
  // faces no longer ask accept.plain_eager() themselves), so a module built from an older accept.cpp
  // is not used.
  m.attr("accept_version") = 2;
}

}  // namespace eagle3
