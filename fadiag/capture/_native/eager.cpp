// The eager SDPA wrapper as a builtin function: a measured call with no Python frame of fadiag's.
//
// Once the dispatcher tap times eager calls, F.scaled_dot_product_attention becomes a builtin
// whose steady call (a signature Python has learned, the tap timing it) is FastBegin.call, reached
// from C: the Python wrapper's checks read here, the call recorded, linked and made. Inside a
// model's step each Python frame of a wrapper costs several times what it does in a tight loop
// (BENCHMARKS.md, runs 97-100). Every other call goes to the Python wrapper, which decides as it
// always has. The builtin is made once per wrapped function and kept for the process (dynamo
// knows it by id: fadiag/capture/eager.py registers it with torch.compiler.substitute_in_graph);
// attach binds it to the session's recorder and detach unbinds it, after which it calls the
// original.

#include <torch/extension.h>

#include <memory>
#include <string>
#include <utility>

namespace fadiag {

#if PY_VERSION_HEX >= 0x030B0000
py::object fast_call(py::handle fast, py::handle original, py::tuple args, py::dict kwargs,
                     py::handle recorder);  // marks.cpp
void tap_enter();                           // tap.cpp: a call of the wrapper begins (Tap.enter)
void tap_exit();                            // and ends (Tap.exit)

namespace {

// Calls every builtin passed to its original while bypassing (cumulative, under the GIL): the
// step boundary reads it in the same C++ call as its cut of the tap's records (Tap.cut_step).
int64_t g_bypassed = 0;

constexpr const char* kCapsule = "fadiag.EagerWrapper";

// The builtin's state (its `__self__` is a capsule holding this).
class EagerWrapper {
 public:
  EagerWrapper(py::object original, py::object compiler)
      : original_(std::move(original)), compiler_(std::move(compiler)) {
    py::object name = py::getattr(original_, "__name__", py::none());
    name_ = py::isinstance<py::str>(name) ? name.cast<std::string>() : "attention";
    py::object doc = py::getattr(original_, "__doc__", py::none());
    if (py::isinstance<py::str>(doc)) doc_ = doc.cast<std::string>();
    def_.ml_name = name_.c_str();
    def_.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&EagerWrapper::entry));
    def_.ml_flags = METH_VARARGS | METH_KEYWORDS;
    def_.ml_doc = doc_.empty() ? nullptr : doc_.c_str();
  }

  PyMethodDef* def() { return &def_; }
  const py::object& original() const { return original_; }

  // `python`: the Python wrapper; `recorder`, `op`: the session's Recorder and the AttentionOp
  // wrapped. All None: unbound (the builtin calls the original).
  void bind(py::object python, py::object recorder, py::object op) {
    bypass_ = false;
    python_ = std::move(python);
    recorder_ = std::move(recorder);
    op_ = std::move(op);
  }
  bool bound() const { return !recorder_.is_none(); }

  // Steady steps named by their order (Recorder.bypass): every call goes to the original, counted,
  // and the dispatcher tap times it as it times compiled code's; the resolver names it from the
  // last verified step. The recorder turns it on and off at step boundaries only.
  void set_bypass(bool on) { bypass_ = on; }

  static PyObject* entry(PyObject* self, PyObject* args, PyObject* kwargs) {
    auto* w = static_cast<EagerWrapper*>(PyCapsule_GetPointer(self, kCapsule));
    return w == nullptr ? nullptr : w->call(args, kwargs);
  }

 private:
  PyObject* call(PyObject* args, PyObject* kwargs) {
    if (recorder_.is_none() || compiling()) return PyObject_Call(original_.ptr(), args, kwargs);
    if (bypass_) {
      ++g_bypassed;
      return PyObject_Call(original_.ptr(), args, kwargs);
    }
    // Held for the call: a detach on another thread may unbind this builtin while it runs.
    const py::object held_recorder = recorder_, held_python = python_, held_op = op_;
    py::object fast;
    switch (state(fast)) {
      case kPython:
        return PyObject_Call(python_.ptr(), args, kwargs);
      case kSampledOut:
        return sampled_out(args, kwargs);
      case kFast:
        break;
    }
    {
      // FastBegin.call hands back NotImplemented before anything is done where the call is not
      // one it takes; what it throws comes from the original or after it ran.
      try {
        py::dict kw = kwargs == nullptr ? py::dict() : py::reinterpret_borrow<py::dict>(kwargs);
        py::object out = fast_call(fast, original_, py::reinterpret_borrow<py::tuple>(args),
                                   std::move(kw), recorder_);
        if (out.ptr() != Py_NotImplemented) return out.release().ptr();
      } catch (py::error_already_set& e) {  // the original's own error: passed on unchanged
        e.restore();
        return nullptr;
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
      }
    }
    return PyObject_Call(python_.ptr(), args, kwargs);
  }

  // torch.export's flag (dynamo itself never runs this: it traces the polyfill instead).
  bool compiling() {
    PyObject* flag = PyObject_GetAttr(compiler_.ptr(), flag_.ptr());
    if (flag == nullptr) {
      PyErr_Clear();
      return false;
    }
    const bool on = flag == Py_True;
    Py_DECREF(flag);
    return on;
  }

  enum State { kPython, kSampledOut, kFast };

  // The Python wrapper's tests, in its order: no wrapped call under way, recording, the tap
  // installed and no graph capture on it; then the fast path learned for this op and measuring
  // (kFast, `fast` set to the recorder's FastBegin, Recorder._fast), or a step sampled out.
  // Anything else, or unexpected, is the Python wrapper's to decide.
  State state(py::object& fast) {
    PyObject* rec = recorder_.ptr();
    State st = kPython;
    if (is(rec, depth_, Py_False) && is(rec, enabled_, Py_True) && tap_free(rec)) {
      if (is(rec, measuring_, Py_False)) {
        st = kSampledOut;
      } else if (same(rec, fast_op_, op_.ptr()) && !same(rec, fast_call_, Py_None)) {
        fast = py::reinterpret_steal<py::object>(PyObject_GetAttr(rec, fast_.ptr()));
        if (fast) st = kFast;
      }
    }
    if (PyErr_Occurred()) {
      PyErr_Clear();
      st = kPython;
    }
    return st;
  }

  // A call of a step sampled out, as the Python wrapper makes it: counted, and the fused op passes
  // the tap untimed.
  PyObject* sampled_out(PyObject* args, PyObject* kwargs) {
    PyObject* rec = recorder_.ptr();
    if (!bump(rec, calls_since_boundary_)) return PyObject_Call(python_.ptr(), args, kwargs);
    bump(rec, sampled_out_);  // a count that cannot be kept is not kept twice by the wrapper
    tap_enter();
    PyObject* out = PyObject_Call(original_.ptr(), args, kwargs);
    tap_exit();
    return out;
  }

  // obj.name += 1; false (the error cleared) where that fails.
  static bool bump(PyObject* obj, const py::str& name) {
    PyObject* v = PyObject_GetAttr(obj, name.ptr());
    PyObject* more = v == nullptr ? nullptr : PyNumber_Add(v, one());
    Py_XDECREF(v);
    const bool ok = more != nullptr && PyObject_SetAttr(obj, name.ptr(), more) == 0;
    Py_XDECREF(more);
    if (!ok) PyErr_Clear();
    return ok;
  }

  static PyObject* one() {
    static PyObject* value = PyLong_FromLong(1);  // immortal enough: held for the process
    return value;
  }

  bool tap_free(PyObject* rec) {
    py::object tap = py::reinterpret_steal<py::object>(PyObject_GetAttr(rec, tap_.ptr()));
    return tap && !tap.is_none() && is(tap.ptr(), capturing_, Py_False);
  }

  // Whether `obj.name` is true (Py_True) or false (Py_False) as Python's `if` reads it.
  static bool is(PyObject* obj, const py::str& name, PyObject* want) {
    PyObject* v = PyObject_GetAttr(obj, name.ptr());
    if (v == nullptr) return false;
    const int truth = PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth >= 0 && (truth == 1) == (want == Py_True);
  }

  static bool same(PyObject* obj, const py::str& name, PyObject* want) {
    PyObject* v = PyObject_GetAttr(obj, name.ptr());
    if (v == nullptr) return false;
    Py_DECREF(v);  // compared by identity only
    return v == want;
  }

  bool bypass_ = false;
  py::object original_, compiler_;
  py::object python_ = py::none(), recorder_ = py::none(), op_ = py::none();
  std::string name_, doc_;
  PyMethodDef def_{};
  py::str flag_{"_is_compiling_flag"}, depth_{"depth"}, enabled_{"enabled"},
      measuring_{"measuring"}, fast_op_{"_fast_op"}, fast_call_{"_fast_call"}, fast_{"_fast"},
      tap_{"tap"}, capturing_{"capturing"}, calls_since_boundary_{"calls_since_boundary"},
      sampled_out_{"sampled_out"};
};

EagerWrapper* wrapper_of(py::handle fn) {
  if (PyCFunction_Check(fn.ptr())) {
    PyObject* self = PyCFunction_GET_SELF(fn.ptr());
    if (self != nullptr && PyCapsule_IsValid(self, kCapsule)) {
      return static_cast<EagerWrapper*>(PyCapsule_GetPointer(self, kCapsule));
    }
  }
  throw py::type_error("not a builtin made by eager_wrapper()");
}

}  // namespace

int64_t eager_bypassed() { return g_bypassed; }

void bind_eager(py::module_& m) {
  // A builtin function calling `original`, named and documented as it is; `compiler`: the
  // torch.compiler module (its _is_compiling_flag is torch.export's).
  m.def("eager_wrapper", [](py::object original, py::object compiler) {
    auto owned = std::make_unique<EagerWrapper>(std::move(original), std::move(compiler));
    py::object capsule = py::reinterpret_steal<py::object>(
        PyCapsule_New(owned.get(), kCapsule, [](PyObject* c) {
          delete static_cast<EagerWrapper*>(PyCapsule_GetPointer(c, kCapsule));
        }));
    if (!capsule) throw py::error_already_set();
    EagerWrapper* w = owned.release();  // the capsule's now
    py::str module("fadiag");
    PyObject* fn = PyCFunction_NewEx(w->def(), capsule.ptr(), module.ptr());
    if (fn == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(fn);
  });
  m.def("eager_bind", [](py::handle fn, py::object python, py::object recorder, py::object op) {
    wrapper_of(fn)->bind(std::move(python), std::move(recorder), std::move(op));
  });
  m.def("eager_bound", [](py::handle fn) { return wrapper_of(fn)->bound(); });
  m.def("eager_original", [](py::handle fn) { return wrapper_of(fn)->original(); });
  m.def("eager_bypass", [](py::handle fn, bool on) { wrapper_of(fn)->set_bypass(on); });
  m.def("eager_bypassed", &eager_bypassed);
}

#else

void bind_eager(py::module_&) {}  // FastBegin needs Python 3.11: the Python wrapper stays
int64_t eager_bypassed() { return 0; }

#endif

}  // namespace fadiag
