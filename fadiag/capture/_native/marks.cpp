// Timing marks taken in C++: forward marks called from Python, backward marks taken by autograd
// node hooks that never take the GIL.
//
// A mark is a slot in a pool. On CUDA a slot holds a timing event recorded on the current stream
// (the autograd engine makes the node's stream current before running its hooks); on CPU it holds
// a steady-clock reading. Slot numbers are handed out by Python under the GIL; hooks only write to
// slots they were given, and a slot's generation guards against a late hook writing into a slot
// that has since been reused. Nothing here synchronises with the device, and nothing thrown here
// ever reaches the autograd engine: errors are counted and read from Python.
//
// `FastBegin` is the start of a measured SDPA call in its steady state (a signature seen before,
// grad on, not a recomputation, no backward since the last call): what Recorder.begin does in
// Python, in one C++ call. Anything else it hands back to Python by returning None, before it has
// changed anything. A signature the dispatcher tap times (`linked`) takes no mark here: the call
// gets a link number instead, and the tap times its kernels (tap.cpp).

#include <torch/extension.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include "pool.h"

#include <structmember.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#ifdef FADIAG_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace fadiag {
int64_t tap_link();  // tap.cpp: the current wrapped call is the tap's to time; its link number
void tap_enter();    // tap.cpp: a call of the Python wrapper begins (Tap.enter)
void tap_exit();     // and ends (Tap.exit)
}

namespace {

using fadiag::Pool;
using torch::autograd::variable_list;

// Backward start: the first time the node runs, before its kernels are queued.
struct StartHook : torch::autograd::FunctionPreHook {
  StartHook(std::shared_ptr<Pool> pool, int64_t slot, uint32_t generation)
      : pool_(std::move(pool)), slot_(slot), generation_(generation) {}

  // Compiled autograd replays the backward without calling node hooks; a hook that does not
  // describe itself is left out of its graph (its mark stays unrecorded), which is what the
  // resolver expects of a backward it never saw. fadiag uses Python hooks, which compiled
  // autograd does run, whenever it is switched on at forward time.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

  variable_list operator()(const variable_list& grads) override {
    if (!fired_) {
      fired_ = true;
      if (pool_->mark(slot_, generation_, true)) pool_->backward_started();
    }
    return grads;
  }

  std::shared_ptr<Pool> pool_;
  int64_t slot_;
  uint32_t generation_;
  bool fired_ = false;
};

// Backward end: after the node that produces the gradients of q, k and v has run. It closes the
// window the start hook's slot opened (Pool::mark's `since`).
struct EndHook : torch::autograd::FunctionPostHook {
  EndHook(std::shared_ptr<Pool> pool, int64_t slot, uint32_t generation, int64_t start,
          uint32_t start_generation)
      : pool_(std::move(pool)), slot_(slot), generation_(generation), start_(start),
        start_generation_(start_generation) {
    pool_->armed();
  }

  // A graph freed without a backward (evaluation with grad on, an unused output) disarms too.
  ~EndHook() override {
    if (!fired_) pool_->disarmed();
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

  variable_list operator()(const variable_list& grad_inputs,
                           const variable_list& /*grad_outputs*/) override {
    if (!fired_) {
      fired_ = true;
      const bool start_held = pool_->generation(start_) == start_generation_;
      if (pool_->mark(slot_, generation_, true, false, start_held ? start_ : -1)) {
        pool_->backward_ended();
      }
      pool_->disarmed();
    }
    return grad_inputs;
  }

  std::shared_ptr<Pool> pool_;
  int64_t slot_;
  uint32_t generation_;
  int64_t start_;
  uint32_t start_generation_;
  bool fired_ = false;
};

class Marks {
 public:
  explicit Marks(bool cuda) : pool_(std::make_shared<Pool>(cuda)) {}

  void ensure(int64_t n) { pool_->ensure(n); }
  bool mark(int64_t slot) { return pool_->mark(slot, 0, false); }
  // None (a Python-hooked call whose backward has not run) is not recorded.
  bool recorded(std::optional<int64_t> slot) const { return slot && pool_->recorded(*slot); }
  bool done(int64_t slot) { return pool_->done(slot); }
  double elapsed(int64_t a, int64_t b) { return pool_->elapsed(a, b); }
  void release(int64_t slot) { pool_->release(slot); }

  // A slot taken from the pool and marked now: one call per mark from Python. A window's end
  // mark names its start (`since`: Pool::mark).
  int64_t take(std::optional<int64_t> since) { return pool_->take_marked(false, since.value_or(-1)); }
  void give_back(std::optional<int64_t> slot) {
    if (slot) pool_->give_back(*slot);
  }
  void give_back_all(const std::vector<int64_t>& slots) {
    pool_->give_back_all(slots);
  }

  // A step's seconds in one call, made without the GIL. `slots` holds four per call: forward
  // start, forward end, backward start, backward end (-1: none). None while a mark the device
  // has not passed is needed (see Pool::read_call); otherwise four per call, as read_call reads
  // them (a call whose forward marks failed reads NaN: counted as errors when they did).
  std::optional<std::vector<double>> seconds(const std::vector<int64_t>& slots,
                                             bool give_up_open_backward) {
    TORCH_CHECK(slots.size() % 4 == 0, "fadiag marks: four slots per call");
    std::vector<double> out(slots.size(), 0.0);
    for (size_t i = 0; i < slots.size(); i += 4) {
      if (!pool_->read_call(slots[i], slots[i + 1], slots[i + 2], slots[i + 3],
                            give_up_open_backward, &out[i])) {
        return std::nullopt;
      }
    }
    return out;
  }
  int64_t slots() { return pool_->slots(); }
  int64_t in_use() { return pool_->in_use(); }

  // Hook the backward of `out`'s autograd node (start) and of the node `path` leads to from it
  // (end: the fused attention node). False when `out` has no grad_fn or the path is broken.
  bool hook(const at::Tensor& out, int64_t start_slot, int64_t end_slot,
            const std::vector<int64_t>& path) {
    const auto& node = out.grad_fn();
    if (!node) return false;
    auto end = node;  // shared_ptr or intrusive_ptr, depending on the torch version
    for (int64_t i : path) {
      if (i < 0 || static_cast<uint32_t>(i) >= end->num_outputs()) return false;
      end = end->next_edge(static_cast<size_t>(i)).function;
      if (!end) return false;
    }
    node->add_pre_hook(std::make_unique<StartHook>(pool_, start_slot, pool_->generation(start_slot)));
    end->add_post_hook(std::make_unique<EndHook>(pool_, end_slot, pool_->generation(end_slot),
                                                 start_slot, pool_->generation(start_slot)));
    return true;
  }

  // The end of a measured forward in one call: the end mark of the window `start` opened (taken
  // first, so the window holds nothing of this), then the backward hooks on fresh slots. Returns
  // (forward end, backward start, backward end); the last two are None if `out` cannot be hooked.
  std::tuple<int64_t, std::optional<int64_t>, std::optional<int64_t>> finish(
      const at::Tensor& out, const std::vector<int64_t>& path, int64_t start) {
    const int64_t fwd = take(start);
    const int64_t bwd0 = pool_->take();
    const int64_t bwd1 = pool_->take();
    if (hook(out, bwd0, bwd1, path)) return {fwd, bwd0, bwd1};
    pool_->give_back(bwd0);
    pool_->give_back(bwd1);
    return {fwd, std::nullopt, std::nullopt};
  }

  int64_t events_created() const { return pool_->events_created(); }
  int64_t errors() const { return pool_->errors(); }
  int64_t captured() const { return pool_->captured(); }
  bool capturing() const { return pool_->capturing(); }
  int64_t backward_starts() const { return pool_->backward_starts(); }
  int64_t in_backward() const { return pool_->in_backward(); }
  void reset_in_backward() { pool_->reset_in_backward(); }
  bool window() const { return pool_->window(); }
  bool wait_window(double timeout_s) { return pool_->wait_window(timeout_s); }
  void wake_window() { pool_->wake_window(); }

  std::shared_ptr<Pool> pool() const { return pool_; }

 private:
  std::shared_ptr<Pool> pool_;
};

#if PY_VERSION_HEX >= 0x030B0000  // PyFrame_GetLasti
namespace py = pybind11;

// Everything that tells SDPA calls apart, as Recorder.begin's signature key does (and no less).
struct FastKey {
  std::vector<int64_t> v;
  bool operator==(const FastKey& o) const { return v == o.v; }
};

struct FastKeyHash {
  size_t operator()(const FastKey& k) const {
    size_t h = 0;
    for (int64_t x : k.v) h = h * 1000003u ^ std::hash<int64_t>()(x);
    return h;
  }
};

class FastBegin {
 public:
  // `timer`: the NativeTimer whose marks these are, serving tensors on `device_type`;
  // `internal`, `locations`, `site_counts`: the Recorder's site dicts (code -> is internal,
  // (code, lasti) -> "file:line", "file:line" -> calls this pass); `call_class`: Recorder's Call;
  // `skip`: frames between this call and the wrapper's caller.
  FastBegin(Marks& marks, py::object timer, const std::string& device_type, py::dict internal,
            py::dict locations, py::dict site_counts, py::object call_class, int64_t skip,
            int64_t max_calls)
      : pool_(marks.pool()),
        timer_(std::move(timer)),
        device_type_(c10::Device(device_type).type()),
        internal_(std::move(internal)),
        locations_(std::move(locations)),
        site_counts_(std::move(site_counts)),
        call_class_(std::move(call_class)),
        skip_(skip),
        max_calls_(max_calls),
        seen_name_("backward_starts_seen"),
        sig_name_("sig"),
        fwd0_name_("fwd0"),
        link_name_("link"),
        calls_name_("calls"),
        backward_seen_name_("backward_seen"),
        depth_name_("depth"),
        aborted_name_("aborted"),
        on_error_name_("_on_error"),
        step_index_name_("step_index"),
        open_phase_name_("open_phase") {}

  // The call's record (already in `calls`, its forward start mark taken), or None.
  py::object begin(py::tuple args, py::dict kwargs, py::list calls, bool backward_seen) {
    py::object loc;
    const Known* known = find(args, kwargs, calls, backward_seen, skip_, loc);
    if (known == nullptr) return py::none();
    py::object call = record(*known, args, loc);
    calls.append(call);
    if (known->linked) {
      call.attr(link_name_) = py::int_(fadiag::tap_link());
    } else {  // the start mark last, as Python's path takes it
      call.attr(fwd0_name_) = py::int_(pool_->take_marked());
    }
    return call;
  }

  // The whole steady-state call of a signature the dispatcher tap times, called by the wrapper
  // in place of Tap.enter, Recorder.begin, `original` and Tap.exit: the call recorded and linked,
  // `original(*args, **kwargs)` called and its result returned. NotImplemented where the call is
  // not one it takes (Python's path then runs), before anything is changed but a new micro-batch
  // opened, as Python's path would open it first. `skip`: frames from the current one to the
  // wrapper's caller (1 from the Python wrapper, 0 from eager.cpp's).
  py::object call(py::handle original, py::tuple args, py::dict kwargs, py::handle recorder,
                  int64_t skip) {
    const Known* known = nullptr;
    py::list calls;
    py::object loc;
    try {
      py::object held = recorder.attr(calls_name_);
      int backward_seen = PyObject_IsTrue(recorder.attr(backward_seen_name_).ptr());
      if (backward_seen < 0) throw py::error_already_set();
      if ((backward_seen == 1 || backward_ran()) && opens_phase(held)) {
        // The first call after a backward (a micro-batch's): Python opens the phase as its own
        // path does (Recorder.open_phase), and the call goes on here. Where that closed a step
        // (no optimizer seen: each micro-batch is a step), the rest is Python's path.
        py::object step = recorder.attr(step_index_name_);
        recorder.attr(open_phase_name_)();
        py::object now = recorder.attr(step_index_name_);
        if (!now.equal(step)) {
          return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        }
        held = recorder.attr(calls_name_);
        backward_seen = PyObject_IsTrue(recorder.attr(backward_seen_name_).ptr());
        if (backward_seen < 0) throw py::error_already_set();
      }
      if (PyList_Check(held.ptr())) {  // the recorder's own list, not a copy of something else
        calls = py::reinterpret_borrow<py::list>(held);
        known = find(args, kwargs, calls, backward_seen == 1, skip, loc);
      }
    } catch (const std::exception&) {  // error_already_set too: the error is fetched, cleared
      known = nullptr;  // Python's path meets the same failure, and counts it
    }
    if (known == nullptr || !known->linked) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
    fadiag::tap_enter();
    struct Exit {
      ~Exit() { fadiag::tap_exit(); }
    } exit;
    py::object call, failure;
    try {
      call = record(*known, args, loc);
      call.attr(link_name_) = py::int_(fadiag::tap_link());
      calls.append(call);
    } catch (py::error_already_set& e) {
      failure = e.value();
    } catch (const std::exception& e) {
      failure = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_RuntimeError, "s", e.what()));
    }
    if (failure) {
      // As Recorder.begin's own failure: counted and logged once, the call made unmeasured (it
      // is appended last, so a failure leaves nothing in `calls`).
      call = py::object();
      recorder.attr(on_error_name_)("recorder.begin", failure);
    }
    // Recorder.depth, as the Python path keeps it: a wrapped call made inside this one passes.
    recorder.attr(depth_name_) = py::int_(1);
    PyObject* out = PyObject_Call(original.ptr(), args.ptr(), kwargs.ptr());
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);  // kept across the attribute writes below
    recorder.attr(depth_name_) = py::int_(0);
    if (out == nullptr) {
      if (call) call.attr(aborted_name_) = py::bool_(true);
      PyErr_Restore(type, value, trace);
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(out);
  }

  // Python found `sig` for these arguments: later calls like them take the fast path (`linked`:
  // timed by the dispatcher tap, whose pool is this timer's).
  void remember(py::tuple args, py::dict kwargs, py::object sig, bool linked) {
    FastKey key;
    if (make_key(args, kwargs, key)) sigs_[std::move(key)] = Known{std::move(sig), linked};
  }

  int64_t size() const { return static_cast<int64_t>(sigs_.size()); }
  int64_t skip() const { return skip_; }

 private:
  struct Known {
    py::object sig;
    bool linked = false;
  };

  // A backward ran since the recorder last looked (its timer's count moved).
  bool backward_ran() {
    return py::cast<int64_t>(timer_.attr(seen_name_)) != pool_->backward_starts();
  }

  // Whether Python's path would open a phase for this call before anything else, and the call
  // may be a steady one: grad on, not a recomputation, the step's calls under the cap
  // (Recorder.begin's order).
  bool opens_phase(const py::object& calls) const {
    return c10::GradMode::is_enabled() && torch::autograd::get_current_graph_task_id() == -1 &&
           PyList_Check(calls.ptr()) && PyList_GET_SIZE(calls.ptr()) < max_calls_;
  }

  // The learned signature of a steady-state call (grad on, no recomputation, no backward since
  // the last call, under the per-step cap, its site known: `loc`), or null: then nothing was
  // changed. `skip`: frames from the calling one to the wrapper's caller.
  const Known* find(const py::tuple& args, const py::dict& kwargs, const py::list& calls,
                    bool backward_seen, int64_t skip, py::object& loc) {
    // Not with grad off, in a recomputation, past the cap, or first after a backward (its
    // phase is opened first: call()).
    if (backward_seen || !opens_phase(calls) || backward_ran()) return nullptr;
    // The key is built in one buffer kept between calls: no allocation on the steady path.
    scratch_.v.clear();
    if (!make_key(args, kwargs, scratch_)) return nullptr;
    auto found = sigs_.find(scratch_);
    if (found == sigs_.end()) return nullptr;
    // A stream a CUDA graph captures takes no mark: Python counts the call (the tap, where it
    // times the call, sees the capture itself).
    if (!found->second.linked && pool_->capturing()) return nullptr;
    loc = location(skip);
    if (!loc) return nullptr;
    return &found->second;
  }

  // The call's Python record, its site at `loc` counted; the caller appends it to the step's calls.
  py::object record(const Known& known, const py::tuple& args, const py::object& loc) {
    PyObject* count = PyDict_GetItem(site_counts_.ptr(), loc.ptr());  // borrowed
    const int64_t n = count == nullptr ? 0 : PyLong_AsLongLong(count);
    site_counts_[loc] = py::int_(n + 1);
    py::object site = site_name(loc, n);
    py::object qkv = known.linked ? py::object(py::none())
                                  : py::object(py::make_tuple(args[0], args[1], args[2]));
    py::object call = new_call(site, qkv);
    call.attr(sig_name_) = known.sig;
    return call;
  }

  // A Call(site, timer, False, None, None, qkv) without running Python's __init__ (a frame of
  // twenty attribute stores, the wrapper's costliest piece inside a model's step): its slots
  // copied from a template Call that __init__ made, then the per-call ones written. Where the
  // class is not what this expects (a slot that is not a plain object member, a default that
  // is not immutable), every call goes through __init__.
  py::object new_call(const py::object& site, const py::object& qkv) {
    if (!fields_read_) read_fields();
    if (fields_.empty()) return call_class_(site, timer_, false, py::none(), py::none(), qkv);
    auto* type = reinterpret_cast<PyTypeObject*>(call_class_.ptr());
    PyObject* obj = type->tp_alloc(type, 0);
    if (obj == nullptr) throw py::error_already_set();
    char* from = reinterpret_cast<char*>(template_.ptr());
    char* to = reinterpret_cast<char*>(obj);
    for (const Py_ssize_t off : fields_) {
      PyObject* v = *reinterpret_cast<PyObject**>(from + off);
      Py_XINCREF(v);
      *reinterpret_cast<PyObject**>(to + off) = v;
    }
    py::object call = py::reinterpret_steal<py::object>(obj);
    set_field(to, site_off_, site);
    set_field(to, timer_off_, timer_);
    set_field(to, qkv_off_, qkv);
    set_field(to, host_ns_off_, py::int_(fadiag::steady_ns()));  // time.monotonic_ns()'s clock
    return call;
  }

  static void set_field(char* obj, Py_ssize_t off, const py::object& value) {
    PyObject** slot = reinterpret_cast<PyObject**>(obj + off);
    PyObject* old = *slot;
    *slot = py::object(value).release().ptr();
    Py_XDECREF(old);
  }

  // The offsets of Call's slots and a template Call, once; none where the class has anything
  // else (its construction then stays __init__'s).
  void read_fields() {
    fields_read_ = true;
    try {
      auto* type = reinterpret_cast<PyTypeObject*>(call_class_.ptr());
      if (!PyType_Check(call_class_.ptr()) || type->tp_dictoffset != 0 ||
          type->tp_base != &PyBaseObject_Type) {
        return;  // a __dict__ or a base class of its own: not the plain slotted class
      }
      py::object made = call_class_(py::str(""), timer_, false, py::none(), py::none(), py::none());
      std::vector<Py_ssize_t> offsets;
      std::unordered_map<std::string, Py_ssize_t> named;
      for (py::handle name : py::tuple(call_class_.attr("__slots__"))) {
        PyObject* d = PyDict_GetItem(type->tp_dict, name.ptr());  // borrowed
        if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) return;
        PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return;
        const std::string field = py::cast<std::string>(name);
        PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(made.ptr()) + m->offset);
        const bool per_call = field == "site" || field == "timer" || field == "qkv" ||
                              field == "host_ns";  // written for each call below
        if (v == nullptr || !(per_call || v == Py_None || PyBool_Check(v) ||
                              PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
                              PyUnicode_CheckExact(v))) {
          return;  // unset, or a default that calls would share and could change
        }
        offsets.push_back(m->offset);
        named[field] = m->offset;
      }
      for (const char* need : {"site", "timer", "qkv", "host_ns"}) {
        if (named.count(need) == 0) return;
      }
      site_off_ = named["site"];
      timer_off_ = named["timer"];
      qkv_off_ = named["qkv"];
      host_ns_off_ = named["host_ns"];
      template_ = std::move(made);
      fields_ = std::move(offsets);
    } catch (py::error_already_set&) {
      fields_.clear();  // fetched and cleared: __init__ makes every call
    }
  }

  // "file:line#n", the site of the n-th call from `loc` in this pass, as Recorder._site names it;
  // each string made once per location and ordinal (a step's calls repeat them every pass).
  py::object site_name(const py::object& loc, int64_t n) {
    auto& names = site_names_[loc.ptr()];
    if (names.first.ptr() != loc.ptr()) names.first = loc;  // holds the location string alive
    auto& made = names.second;
    if (n < static_cast<int64_t>(made.size())) return made[static_cast<size_t>(n)];
    py::object site = py::reinterpret_steal<py::object>(
        PyUnicode_FromFormat("%U#%lld", loc.ptr(), static_cast<long long>(n)));
    if (n == static_cast<int64_t>(made.size()) && n < kSiteNames) made.push_back(site);
    return site;
  }

  // A plain tensor: torch.Tensor or Parameter itself (a subclass may answer .shape its own way),
  // strided and not nested (its sizes are plain integers).
  static bool tensor(PyObject* o, at::Tensor& out) {
    if (!THPVariable_CheckExact(o)) return false;
    out = THPVariable_Unpack(o);
    return !out.is_nested() && out.layout() == at::kStrided;
  }

  static void shape(const at::Tensor& t, std::vector<int64_t>& v) {
    v.push_back(t.dim());
    for (int64_t s : t.sizes()) v.push_back(s);
  }

  // q, k, v by position; attn_mask, dropout_p, is_causal by position or keyword; enable_gqa by
  // keyword (as quick_sdpa reads them; scale changes no kernel choice). False: leave the call to
  // Python.
  bool make_key(const py::tuple& args, const py::dict& kwargs, FastKey& key) const {
    const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
    if (n < 3) return false;
    auto arg = [&](Py_ssize_t i, const char* name) -> PyObject* {
      if (n > i) return PyTuple_GET_ITEM(args.ptr(), i);
      return PyDict_GetItemString(kwargs.ptr(), name);  // borrowed, or null
    };
    at::Tensor q, k, v;
    if (!tensor(PyTuple_GET_ITEM(args.ptr(), 0), q) || !tensor(PyTuple_GET_ITEM(args.ptr(), 1), k) ||
        !tensor(PyTuple_GET_ITEM(args.ptr(), 2), v)) {
      return false;
    }
    if (q.device().type() != device_type_) return false;
    auto& out = key.v;
    out.reserve(40);
    shape(q, out);
    shape(k, out);
    shape(v, out);
    out.push_back(static_cast<int64_t>(q.scalar_type()));
    out.push_back(q.device().index());
    out.push_back(q.requires_grad());
    out.push_back(k.requires_grad());
    out.push_back(v.requires_grad());
    // The global SDPA backend switches (torch.backends.cuda.enable_*_sdp, sdpa_kernel).
    const auto& ctx = at::globalContext();
    out.push_back(ctx.userEnabledFlashSDP());
    out.push_back(ctx.userEnabledMemEfficientSDP());
    out.push_back(ctx.userEnabledMathSDP());
    out.push_back(ctx.userEnabledCuDNNSDP());
    PyObject* dropout = arg(4, "dropout_p");
    double p = 0.0;
    if (dropout != nullptr) {
      p = PyFloat_AsDouble(dropout);
      if (p == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
    }
    out.push_back(p > 0.0);
    for (PyObject* o : {arg(5, "is_causal"), PyDict_GetItemString(kwargs.ptr(), "enable_gqa")}) {
      const int truth = o == nullptr ? 0 : PyObject_IsTrue(o);
      if (truth < 0) {
        PyErr_Clear();
        return false;
      }
      out.push_back(truth);
    }
    PyObject* mask = arg(3, "attn_mask");
    at::Tensor m;
    if (mask == nullptr || mask == Py_None) {
      out.push_back(0);
    } else if (tensor(mask, m)) {
      out.push_back(2);
      out.push_back(static_cast<int64_t>(m.scalar_type()));
      out.push_back(m.requires_grad());
      shape(m, out);
    } else {
      return false;  // a mask that is not a tensor: Python's reader decides
    }
    return true;
  }

  // The caller's "file:line" as Recorder._site finds it (the first frame outside torch and
  // fadiag), if both lookups are cached; null otherwise.
  py::object location(int64_t skip) {
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the frame that called this
    Py_XINCREF(frame);
    for (int64_t i = 0; i < skip && frame != nullptr; ++i) {
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
    if (frame == nullptr) return py::object();
    while (true) {
      PyFrameObject* back = PyFrame_GetBack(frame);
      if (back == nullptr) break;
      PyCodeObject* code = PyFrame_GetCode(frame);
      const int flag = internal(reinterpret_cast<PyObject*>(code));
      Py_DECREF(code);
      if (flag != 1) {
        Py_DECREF(back);
        if (flag < 0) {  // a code object Python has not classified yet
          Py_DECREF(frame);
          return py::object();
        }
        break;
      }
      Py_DECREF(frame);
      frame = back;
    }
    PyCodeObject* code = PyFrame_GetCode(frame);
    const int lasti = PyFrame_GetLasti(frame);
    Py_DECREF(frame);
    py::object owned = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(code));
    auto& loc = known_locations_[{owned.ptr(), lasti}];
    if (!loc.second) {
      py::tuple lk = py::make_tuple(owned, py::int_(lasti));
      PyObject* found = PyDict_GetItem(locations_.ptr(), lk.ptr());  // borrowed
      if (found == nullptr) return py::object();
      loc = {owned, py::reinterpret_borrow<py::object>(found)};
    }
    return loc.second;
  }

  // Python's classification of a code object (Sites.internal: 1 torch's or fadiag's, 0 not, -1
  // not classified yet), cached by address: hashing a code object hashes its constants and
  // names, ~0.3-1.6 us a lookup. The cache holds each code object it keys, so no address is
  // reused while it is there.
  int internal(PyObject* code) {
    auto found = known_internal_.find(code);
    if (found != known_internal_.end()) return found->second.second;
    PyObject* flag = PyDict_GetItem(internal_.ptr(), code);  // borrowed
    if (flag == nullptr) return -1;
    const int value = flag == Py_True ? 1 : 0;
    known_internal_.emplace(code, std::make_pair(py::reinterpret_borrow<py::object>(code), value));
    return value;
  }

  struct CodeAt {
    size_t operator()(const std::pair<PyObject*, int>& k) const {
      return std::hash<const void*>()(k.first) * 31u + static_cast<size_t>(k.second);
    }
  };
  // Code object -> (the object, held; its classification); (code, bytecode offset) -> (the code
  // object, held; its "file:line"): Sites' dicts, read once per key.
  std::unordered_map<PyObject*, std::pair<py::object, int>> known_internal_;
  std::unordered_map<std::pair<PyObject*, int>, std::pair<py::object, py::object>, CodeAt>
      known_locations_;

  std::shared_ptr<Pool> pool_;
  py::object timer_;
  c10::DeviceType device_type_;
  py::dict internal_, locations_, site_counts_;
  py::object call_class_;
  bool fields_read_ = false;
  std::vector<Py_ssize_t> fields_;  // Call's slots, by offset (empty: __init__ makes each call)
  py::object template_;             // a Call that __init__ made: every slot's default
  Py_ssize_t site_off_ = 0, timer_off_ = 0, qkv_off_ = 0, host_ns_off_ = 0;
  int64_t skip_;
  int64_t max_calls_;
  static constexpr int64_t kSiteNames = 4096;  // ordinals per location kept as strings, at most
  py::str seen_name_, sig_name_, fwd0_name_, link_name_, calls_name_, backward_seen_name_,
      depth_name_, aborted_name_, on_error_name_, step_index_name_, open_phase_name_;
  std::unordered_map<FastKey, Known, FastKeyHash> sigs_;
  FastKey scratch_;
  // Location string (pointer) -> (the string, its sites by ordinal).
  std::unordered_map<PyObject*, std::pair<py::object, std::vector<py::object>>> site_names_;
};
#endif

}  // namespace

namespace fadiag {
void bind_tap(pybind11::module_& m);    // tap.cpp
void bind_eager(pybind11::module_& m);  // eager.cpp

#if PY_VERSION_HEX >= 0x030B0000
// FastBegin.call for eager.cpp's wrapper, which calls it with no Python frame of its own: `fast`
// is a FastBegin (Recorder._fast).
py::object fast_call(py::handle fast, py::handle original, py::tuple args, py::dict kwargs,
                     py::handle recorder) {
  FastBegin* f = nullptr;
  try {
    f = &py::cast<FastBegin&>(fast);
  } catch (const py::cast_error&) {  // not one (yet): the Python wrapper's path
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  return f->call(original, std::move(args), std::move(kwargs), recorder, 0);
}
#endif

// The CUDA caching allocator's aggregate allocated bytes on `device` (-1: the calling thread's
// current device): (current, peak, allocated so far). Three numbers read under the allocator's
// lock, where torch._C._cuda_memoryStats builds every statistic as nested dicts (~28 us a step
// on the resolver thread, with the GIL held). None in a build without CUDA.
std::optional<std::tuple<int64_t, int64_t, int64_t>> allocator_stats(int64_t device) {
#ifdef FADIAG_CUDA
  const auto index = device < 0 ? c10::cuda::current_device() : static_cast<c10::DeviceIndex>(device);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const auto& all = stats.allocated_bytes[0];  // StatType::AGGREGATE
  return std::make_tuple(all.current, all.peak, all.allocated);
#else
  (void)device;
  return std::nullopt;
#endif
}
}  // namespace fadiag

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fadiag timing marks taken in C++ (forward marks and autograd node hooks)";
#ifdef FADIAG_CUDA
  m.attr("cuda") = true;
#else
  m.attr("cuda") = false;
#endif
  // The pool behind a Marks object, for the dispatcher tap (its records use the same slots).
  pybind11::class_<Pool, std::shared_ptr<Pool>>(m, "Pool");
  pybind11::class_<Marks>(m, "Marks")
      .def(pybind11::init<bool>(), pybind11::arg("cuda"))
      .def("ensure", &Marks::ensure)
      .def("mark", &Marks::mark)
      .def("recorded", &Marks::recorded)
      .def("done", &Marks::done)
      .def("elapsed", &Marks::elapsed)
      .def("release", &Marks::release)
      .def("take", &Marks::take, pybind11::arg("since") = pybind11::none())
      .def("give_back", &Marks::give_back)
      .def("give_back_all", &Marks::give_back_all)
      .def("seconds", &Marks::seconds, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("slots", &Marks::slots)
      .def("in_use", &Marks::in_use)
      .def("hook", &Marks::hook)
      .def("finish", &Marks::finish)
      .def("events_created", &Marks::events_created)
      .def("errors", &Marks::errors)
      .def("captured", &Marks::captured)
      .def("capturing", &Marks::capturing)
      .def("backward_starts", &Marks::backward_starts)
      .def("in_backward", &Marks::in_backward)
      .def("reset_in_backward", &Marks::reset_in_backward)
      .def("window", &Marks::window)
      .def("wait_window", &Marks::wait_window,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("wake_window", &Marks::wake_window)
      .def("pool", &Marks::pool);
  fadiag::bind_tap(m);
  fadiag::bind_eager(m);
  m.def("allocator_stats", &fadiag::allocator_stats, pybind11::arg("device") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>());
#if PY_VERSION_HEX >= 0x030B0000
  pybind11::class_<FastBegin>(m, "FastBegin")
      .def(pybind11::init<Marks&, pybind11::object, const std::string&, pybind11::dict,
                          pybind11::dict, pybind11::dict, pybind11::object, int64_t, int64_t>())
      .def("begin", &FastBegin::begin)
      .def("call",  // from the Python wrapper: past its frame (the wrapper has no begin frame)
           [](FastBegin& f, py::handle original, py::tuple args, py::dict kwargs,
              py::handle recorder) {
             return f.call(original, std::move(args), std::move(kwargs), recorder, f.skip() - 1);
           })
      .def("remember", &FastBegin::remember)
      .def("size", &FastBegin::size);
#endif
}
