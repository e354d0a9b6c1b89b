// The C++ kernels' Python face on CPython's own API, for a library's binding file
// (kernels/bindings/). pybind11 costs every file that includes it ~9 s of compiling, its
// general dispatch machinery built again whatever the file binds; this binds the few
// types the kernels take. A function is bound by its address (`def<&f>`), its parameters
// taken by position or by name, with defaults; its result converted back; a C++ exception
// raised as the Python one (c10::ValueError as ValueError, any other as RuntimeError).
// A class is bound as a Python type that owns one C++ object, made by a factory function
// and called through bound methods.
//
// Everything here has internal linkage: each rung's library is a shared object of its own,
// and a template's static members with external linkage would be one per process (gcc's
// unique symbols), shared by the rungs a process loads.
#pragma once

#include "torch_ext.h"

#include <Python.h>
#include <torch/csrc/Dtype.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// torch's tensor object and the two names of libtorch_python the binding needs, declared
// here: their header (torch/csrc/autograd/python_variable.h) includes pybind11. The
// layout is checked as a module loads (make_module).
struct TorchTensorObject {
  PyObject_HEAD
  at::Tensor cdata;
};
extern PyObject* THPVariableClass;
PyObject* THPVariable_Wrap(at::TensorBase&& var);

namespace splitserve::python {
namespace {

// A Python exception to raise: its type and message (no type: Python's error is set).
struct Error {
  PyObject* type = nullptr;
  std::string message;
};

// A dict argument, borrowed for the call.
struct Dict {
  PyObject* ptr;
};

// A parameter: its name and, where a call may leave it out, its default.
struct Arg {
  const char* name;
  PyObject* fallback = nullptr;  // a new reference, kept for the module's life

  Arg operator=(std::nullopt_t) const { return {name, Py_NewRef(Py_None)}; }
  template <typename V>
  Arg operator=(V value) const {
    static_assert(std::is_arithmetic_v<V>, "a default is a number or std::nullopt");
    if constexpr (std::is_integral_v<V>) return {name, PyLong_FromLongLong(value)};
    return {name, PyFloat_FromDouble(value)};
  }
};

inline Arg arg(const char* name) { return {name}; }

// Where each argument of a call goes: `slots[i]` for parameter i (borrowed references).
struct Signature {
  const char* function = nullptr;
  std::vector<Arg> params;

  bool bind(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
            PyObject** slots) const {
    const auto n = static_cast<Py_ssize_t>(params.size());
    if (nargs > n)
      return fail(std::to_string(n) + " arguments at most, got " + std::to_string(nargs));
    std::fill(slots, slots + n, nullptr);
    std::copy(args, args + nargs, slots);
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      Py_ssize_t i = 0;
      while (i < n && PyUnicode_CompareWithASCIIString(key, params[i].name) != 0) ++i;
      if (i == n) return fail("no argument named '" + std::string(PyUnicode_AsUTF8(key)) + "'");
      if (slots[i]) return fail("argument '" + std::string(params[i].name) + "' given twice");
      slots[i] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!slots[i] && !(slots[i] = params[i].fallback))
        return fail("missing argument '" + std::string(params[i].name) + "'");
    return true;
  }

  bool fail(const std::string& why) const {
    PyErr_SetString(PyExc_TypeError, (std::string(function) + "(): " + why).c_str());
    return false;
  }

  std::string where(size_t i) const {
    return std::string(function) + "(): argument '" + params[i].name + "': ";
  }
};

template <typename T>
PyTypeObject* bound_type = nullptr;  // the Python type of a bound class, once added

template <typename T>
struct Instance {
  PyObject_HEAD
  T* value;
};

[[noreturn]] inline void wrong_type(PyObject* o, const char* wanted) {
  throw Error{PyExc_TypeError, std::string("expected ") + wanted + ", got " + Py_TYPE(o)->tp_name};
}

// From<T>: a parameter of type T (less const and &) from a Python object. `Held` is what
// the call keeps while it runs, `pass` what it hands the function.
template <typename T, typename = void>
struct From {  // a bound class, taken by reference
  using Held = T*;
  static T* convert(PyObject* o) {
    if (!bound_type<T> || !PyObject_TypeCheck(o, bound_type<T>)) wrong_type(o, "a kernel object");
    return reinterpret_cast<Instance<T>*>(o)->value;
  }
  static T& pass(T* held) { return *held; }
};

template <typename T>
struct Plain {  // held and passed as is
  using Held = T;
  static T& pass(T& held) { return held; }
};

template <>
struct From<at::Tensor> : Plain<at::Tensor> {
  static at::Tensor convert(PyObject* o) {
    if (!PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(THPVariableClass)))
      wrong_type(o, "a Tensor");
    return reinterpret_cast<TorchTensorObject*>(o)->cdata;
  }
};

template <>
struct From<std::optional<at::Tensor>> : Plain<std::optional<at::Tensor>> {
  static std::optional<at::Tensor> convert(PyObject* o) {
    if (o == Py_None) return std::nullopt;
    return From<at::Tensor>::convert(o);
  }
};

template <>
struct From<double> : Plain<double> {  // a float, or what converts to one (__float__)
  static double convert(PyObject* o) {
    const double value = PyFloat_AsDouble(o);
    if (value == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      wrong_type(o, "a float");
    }
    return value;
  }
};

template <>
struct From<int64_t> : Plain<int64_t> {
  static int64_t convert(PyObject* o) {
    if (!PyIndex_Check(o)) wrong_type(o, "an int");
    const Py_ssize_t value = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (value == -1 && PyErr_Occurred()) throw Error{};  // raised already
    return value;
  }
};

template <>
struct From<bool> : Plain<bool> {
  static bool convert(PyObject* o) {
    if (!PyBool_Check(o)) wrong_type(o, "a bool");
    return o == Py_True;
  }
};

template <>
struct From<std::string> : Plain<std::string> {
  static std::string convert(PyObject* o) {
    if (!PyUnicode_Check(o)) wrong_type(o, "a str");
    const char* text = PyUnicode_AsUTF8(o);
    if (!text) throw Error{};  // raised already (a lone surrogate)
    return text;
  }
};

template <>
struct From<at::ScalarType> : Plain<at::ScalarType> {
  static at::ScalarType convert(PyObject* o) {
    if (!THPDtype_Check(o)) wrong_type(o, "a torch.dtype");
    return reinterpret_cast<THPDtype*>(o)->scalar_type;
  }
};

template <>
struct From<Dict> : Plain<Dict> {
  static Dict convert(PyObject* o) {
    if (!PyDict_Check(o)) wrong_type(o, "a dict");
    return {o};
  }
};

template <typename T>
struct From<std::vector<T>> : Plain<std::vector<T>> {  // a list or tuple
  static std::vector<T> convert(PyObject* o) {
    if (!PyList_Check(o) && !PyTuple_Check(o)) wrong_type(o, "a list");
    std::vector<T> items;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(o); ++i) {
      PyObject* item = PySequence_Fast_GET_ITEM(o, i);
      if constexpr (std::is_pointer_v<T>)  // of bound objects
        items.push_back(From<std::remove_cv_t<std::remove_pointer_t<T>>>::convert(item));
      else
        items.push_back(From<T>::convert(item));
    }
    return items;
  }
};

template <typename... T>
struct From<std::tuple<T...>> : Plain<std::tuple<T...>> {  // a tuple of as many items
  static std::tuple<T...> convert(PyObject* o) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != sizeof...(T))
      wrong_type(o, ("a tuple of " + std::to_string(sizeof...(T))).c_str());
    return items(o, std::index_sequence_for<T...>());
  }
  template <size_t... I>
  static std::tuple<T...> items(PyObject* o, std::index_sequence<I...>) {
    return {From<T>::convert(PyTuple_GET_ITEM(o, I))...};
  }
};

// A result as a new reference.
inline PyObject* to_python(bool value) { return Py_NewRef(value ? Py_True : Py_False); }
inline PyObject* to_python(int64_t value) { return PyLong_FromLongLong(value); }
inline PyObject* to_python(PyObject* value) { return value; }  // made by the function
inline PyObject* to_python(at::Tensor&& value) { return THPVariable_Wrap(std::move(value)); }
inline PyObject* to_python(std::optional<at::Tensor>&& value) {
  return value ? to_python(std::move(*value)) : Py_NewRef(Py_None);
}
inline PyObject* to_python(std::pair<at::Tensor, at::Tensor>&& value) {
  PyObject* first = to_python(std::move(value.first));
  PyObject* second = first ? to_python(std::move(value.second)) : nullptr;
  PyObject* pair = second ? PyTuple_Pack(2, first, second) : nullptr;
  Py_XDECREF(first);
  Py_XDECREF(second);
  return pair;
}
template <typename T>
PyObject* to_python(std::unique_ptr<T>&& value) {
  if (!bound_type<T>) throw Error{PyExc_RuntimeError, "a kernel class that was not added"};
  auto* o = PyObject_New(Instance<T>, bound_type<T>);
  if (!o) return nullptr;
  o->value = value.release();
  return reinterpret_cast<PyObject*>(o);
}

// Releases the GIL while it lives, where asked.
struct GilRelease {
  PyThreadState* state;
  explicit GilRelease(bool release) : state(release ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state) PyEval_RestoreThread(state);
  }
};

inline PyObject* raise_current() {
  try {
    throw;
  } catch (const Error& e) {
    if (e.type) PyErr_SetString(e.type, e.message.c_str());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

template <typename F>
struct Traits;
template <typename R, typename... A>
struct Traits<R (*)(A...)> {
  using Self = void;
  using Result = R;
  using Params = std::tuple<std::remove_cvref_t<A>...>;
};
template <typename R, typename C, typename... A>
struct Traits<R (C::*)(A...)> {
  using Self = C;
  using Result = R;
  using Params = std::tuple<std::remove_cvref_t<A>...>;
};
template <typename R, typename C, typename... A>
struct Traits<R (C::*)(A...) const> : Traits<R (C::*)(A...)> {};

// The Python entry point of function or method F: its signature is set once, as bound.
template <auto F, bool ReleaseGil>
struct Bound {
  using T = Traits<decltype(F)>;
  static constexpr size_t N = std::tuple_size_v<typename T::Params>;
  static inline Signature signature;

  template <typename P>
  static typename From<P>::Held argument(PyObject* const* slots, size_t i) {
    try {
      return From<P>::convert(slots[i]);
    } catch (Error& e) {
      if (e.type) e.message = signature.where(i) + e.message;
      throw;
    }
  }

  template <size_t... I>
  static PyObject* call(PyObject* self, PyObject* const* slots, std::index_sequence<I...>) {
    using Params = typename T::Params;
    std::tuple<typename From<std::tuple_element_t<I, Params>>::Held...> held{
        argument<std::tuple_element_t<I, Params>>(slots, I)...};
    auto invoke = [&] {
      if constexpr (std::is_void_v<typename T::Self>) {
        GilRelease gil(ReleaseGil);
        return F(From<std::tuple_element_t<I, Params>>::pass(std::get<I>(held))...);
      } else {
        auto* object = From<typename T::Self>::convert(self);
        GilRelease gil(ReleaseGil);
        return (object->*F)(From<std::tuple_element_t<I, Params>>::pass(std::get<I>(held))...);
      }
    };
    if constexpr (std::is_void_v<typename T::Result>) {
      invoke();
      return Py_NewRef(Py_None);
    } else {
      return to_python(invoke());
    }
  }

  static PyObject* entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                         PyObject* kwnames) {
    PyObject* slots[N + 1];
    if (!signature.bind(args, nargs, kwnames, slots)) return nullptr;
    try {
      return call(self, slots, std::make_index_sequence<N>());
    } catch (...) {
      return raise_current();
    }
  }

  static PyMethodDef method_def(const char* name, const char* doc, std::vector<Arg> params) {
    if (params.size() != N)
      throw Error{PyExc_ImportError, std::string(name) + " is bound with a wrong argument count"};
    signature = {name, std::move(params)};
    return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry)),
            METH_FASTCALL | METH_KEYWORDS, doc};
  }
};

inline void add(PyObject* module, const char* name, PyObject* value) {
  if (!value || PyModule_AddObject(module, name, value) < 0) {
    Py_XDECREF(value);
    throw Error{PyExc_ImportError, std::string("cannot add ") + name};
  }
}

// Binds function F as `module.name`; ReleaseGil: it runs without the GIL.
template <auto F, bool ReleaseGil = false>
void def(PyObject* module, const char* name, const char* doc, std::vector<Arg> params = {}) {
  auto* method = new PyMethodDef(Bound<F, ReleaseGil>::method_def(name, doc, std::move(params)));
  PyObject* module_name = PyModule_GetNameObject(module);  // kept, as Python asks of a def
  add(module, name, PyCFunction_NewEx(method, nullptr, module_name));
  Py_XDECREF(module_name);
}

// A method of a bound class, for `make_class`.
template <auto M, bool ReleaseGil = false>
PyMethodDef method(const char* name, const char* doc, std::vector<Arg> params) {
  return Bound<M, ReleaseGil>::method_def(name, doc, std::move(params));
}

// Makes class T's Python type, `module.name` in its name but not added there: no Python
// code makes one, a bound factory function returns it.
template <typename T>
void make_class(PyObject* module, const char* name, std::vector<PyMethodDef> methods = {}) {
  methods.push_back({nullptr, nullptr, 0, nullptr});
  auto* kept = new std::vector<PyMethodDef>(std::move(methods));
  auto dealloc = +[](PyObject* self) {
    PyTypeObject* type = Py_TYPE(self);
    delete reinterpret_cast<Instance<T>*>(self)->value;
    PyObject_Free(self);
    Py_DECREF(type);
  };
  PyType_Slot slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(dealloc)},
                         {Py_tp_methods, kept->data()},
                         {0, nullptr}};
  // kept: before Python 3.11 the type's tp_name points into the spec's name
  const auto* qualified = new std::string(std::string(PyModule_GetName(module)) + "." + name);
  PyType_Spec spec{qualified->c_str(), sizeof(Instance<T>), 0,
                   Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (!type) throw Error{PyExc_ImportError, "cannot make the type " + *qualified};
  bound_type<T> = reinterpret_cast<PyTypeObject*>(type);  // kept for the process's life
}

// A submodule of `module`, borrowed.
inline PyObject* submodule(PyObject* module, const char* name) {
  const std::string qualified = std::string(PyModule_GetName(module)) + "." + name;
  PyObject* sub = PyModule_New(qualified.c_str());
  add(module, name, sub);
  return sub;
}

// The extension module of `def`, `bind` having added its contents; nullptr with an
// ImportError where torch is not imported or its tensor layout is not the one above.
inline PyObject* make_module(PyModuleDef* def, void (*bind)(PyObject*)) {
  if (!THPVariableClass) {
    PyErr_SetString(PyExc_ImportError, "import torch before the kernels");
    return nullptr;
  }
  PyObject* module = PyModule_Create(def);
  if (!module) return nullptr;
  try {
    float value = 0.0f;
    at::Tensor probe = at::from_blob(&value, {1}, at::kFloat);
    PyObject* wrapped = THPVariable_Wrap(at::TensorBase(probe));
    const bool same =
        wrapped && reinterpret_cast<TorchTensorObject*>(wrapped)->cdata.is_same(probe);
    Py_XDECREF(wrapped);
    if (!same) throw Error{PyExc_ImportError, "torch's tensor object is not laid out as expected"};
    bind(module);
    return module;
  } catch (...) {
    Py_DECREF(module);
    return raise_current();
  }
}

}  // namespace
}  // namespace splitserve::python

namespace splitserve::api {
namespace {

// A function to lend: its key in a module's `c_api()` dict and its capsule's name
// ("splitserve.<key>", a literal: the capsule keeps the pointer).
struct Lent {
  const char* key;
  const char* capsule;
  void* function;

  template <typename F>
  Lent(const char* key, const char* capsule, F function)
      : key(key), capsule(capsule), function(reinterpret_cast<void*>(function)) {}
};

// A module's `c_api()`: a new dict of `functions`, each in its named capsule.
inline PyObject* lend(std::initializer_list<Lent> functions) {
  PyObject* lent = PyDict_New();
  if (!lent) throw python::Error{};  // raised already
  for (const Lent& f : functions) {
    PyObject* item = PyCapsule_New(f.function, f.capsule, nullptr);
    const bool added = item && PyDict_SetItemString(lent, f.key, item) == 0;
    Py_XDECREF(item);
    if (!added) {
      Py_DECREF(lent);
      throw python::Error{};
    }
  }
  return lent;
}

// The function lent as `function` in `lent` (a module's `c_api()`, or several merged), its
// capsule's name checked.
inline void* borrow_pointer(python::Dict lent, const std::string& function) {
  const std::string name = "splitserve." + function;
  PyObject* capsule = PyDict_GetItemString(lent.ptr, function.c_str());
  TORCH_CHECK(capsule, "the kernel module lends no ", function);
  TORCH_CHECK(PyCapsule_IsValid(capsule, name.c_str()), function, " is not a capsule named ",
              name);
  return PyCapsule_GetPointer(capsule, name.c_str());
}

template <typename F>
F borrow(python::Dict lent, const std::string& function) {
  return reinterpret_cast<F>(borrow_pointer(lent, function));
}

}  // namespace
}  // namespace splitserve::api

#define SPLITSERVE_CONCAT_(a, b) a##b
#define SPLITSERVE_CONCAT(a, b) SPLITSERVE_CONCAT_(a, b)
#define SPLITSERVE_STRING_(a) #a
#define SPLITSERVE_STRING(a) SPLITSERVE_STRING_(a)

// The library's module init: `SPLITSERVE_PYTHON_MODULE(m) { def<&f>(m, ...); }`.
#define SPLITSERVE_PYTHON_MODULE(module)                                                      \
  static void splitserve_bind(PyObject* module);                                             \
  static PyModuleDef splitserve_module_def = {                                               \
      PyModuleDef_HEAD_INIT, SPLITSERVE_STRING(TORCH_EXTENSION_NAME), nullptr, -1, nullptr}; \
  PyMODINIT_FUNC SPLITSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {                        \
    return splitserve::python::make_module(&splitserve_module_def, &splitserve_bind);        \
  }                                                                                          \
  static void splitserve_bind(PyObject* module)
