// The dispatcher tap: a kernel below autograd for each fused attention op and its backward op.
//
// Compiled code (inductor's Python wrapper, AOTAutograd) calls the fused SDPA ops and their
// backward ops through the dispatcher, where no Python wrapper runs. The tap registers, for each
// op, a kernel at the BackendSelect key: the last key before the backend's, which every call of
// the op passes (the key is in every thread's included set, and autograd's kernels, even the
// fallback of ops without a derivative, hand calls on below themselves). The tap hands the call
// on to the next key (redispatch), so the kernel registered for the backend, whichever it is, is
// never touched. Around that call it takes a mark before and a mark after and records what the
// call was (shape, dtype, causal, dropout, whether it ran inside a backward pass). A backward op
// is paired with its forward by the logsumexp (or output) tensor it receives, and what it
// receives besides q, k, v and the incoming gradient is exactly what the forward kept for it. At
// each step boundary the training thread cuts the log (a swap, no Python per record) and the
// resolver thread turns the cut records into calls. Destroying the registrations (uninstall)
// leaves the ops as they were: nothing at BackendSelect, which the dispatcher then skips.
//
// aten's ops get typed kernels, built from the op's own C++ signature in this torch's headers
// (at::_ops::<op>::schema): the call stays unboxed from the caller to the backend. Other ops
// (flash_attn's, registered from Python) get a boxed kernel.
//
// Eager calls go through fadiag's Python wrapper first, which names their call site. A call whose
// signature Python has learned is *linked*: the wrapper gives it a number (`link`) and takes no
// marks; the tap times the op's kernel and its backward op below autograd and tags the record
// with that number, which the resolver uses to join the record to the wrapper's call. Other
// wrapped calls (a signature's first, the math path) are Python's to time: they pass through.
//
// Nothing here takes the GIL on the call path, and nothing thrown by fadiag reaches the caller:
// the op's own errors pass through unchanged, fadiag's are counted.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKey.h>
#include <c10/util/Exception.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#ifdef FADIAG_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

#include "args.h"
#include "pool.h"

// The aten ops the tap types: each op's C++ signature and redispatch (at::_ops::<op>).
#include <ATen/ops/_efficient_attention_backward_ops.h>
#include <ATen/ops/_efficient_attention_forward_ops.h>
#include <ATen/ops/_flash_attention_backward_ops.h>
#include <ATen/ops/_flash_attention_forward_ops.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward_ops.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_ops.h>
#if __has_include(<ATen/ops/_scaled_dot_product_cudnn_attention_backward_ops.h>)
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward_ops.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_ops.h>
#define FADIAG_CUDNN_ATTENTION 1
#endif

// getComputedKernelForDispatchKey (the kernel a wrapper calls) came with torch 2.9.
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define FADIAG_TAP 1
#endif

namespace fadiag {

int64_t eager_bypassed();  // eager.cpp: calls SDPA's builtins passed on while bypassing

#ifdef FADIAG_TAP
namespace {

namespace py = pybind11;

// What Python read from one op's schema: where its arguments and results are.
struct Spec {
  std::string name;      // "aten::_scaled_dot_product_flash_attention"
  std::string overload;  // "" for the default overload
  int64_t op = 0;        // Python's index of the op in its table
  bool backward = false;
  bool bshd = false;     // (B, S, H, D) tensors, or packed (T, H, D) with cumulative lengths
  int64_t q = 0, k = 1, v = 2;
  int64_t causal = -1, dropout = -1, scale = -1;  // argument indices; -1: the op has none
  int64_t cu_q = -1, max_q = -1, max_k = -1;      // packed sequences
  int64_t out = 0, lse = 1;  // forward: result indices; backward: argument indices
  std::vector<int64_t> kept;  // backward: the arguments that are what the forward kept
};

// One forward call, and its backward once that ran.
struct Record {
  int64_t op = 0;
  int64_t f0 = -1, f1 = -1, b0 = -1, b1 = -1;
  int64_t b = 0, h = 0, sq = 0, sk = 0, d = 0, dv = 0, kv_heads = 0;
  at::ScalarType dtype = at::kFloat;
  c10::DeviceType device_type = c10::DeviceType::CPU;
  int64_t device_index = -1;
  bool causal = false;
  double dropout = 0.0;
  double scale = std::numeric_limits<double>::quiet_NaN();
  bool recompute = false;
  int64_t phase = 0;
  int64_t kept = -1;
  bool cuda = false;
  int64_t link = 0;     // the Python wrapper's number for this call; 0: compiled code's call
  int64_t host_ns = 0;  // steady clock at the forward (the hang check's age of a call)
  bool graph_backward = false;  // its backward op ran while a CUDA graph captured the stream
};

constexpr size_t kMaxPairs = 1 << 16;  // pairing entries kept between drains, at most
constexpr int64_t kUnmeasured = -2;  // a forward measured by Python, or not at all: its backward too

thread_local int t_depth = 0;   // inside a tapped op: the ops it calls pass through
thread_local int t_python = 0;  // inside a call of the Python wrapper
thread_local int64_t t_link = 0;  // that call's link: the tap times it (0: Python does, or none)
thread_local bool t_seen = false;  // a tapped forward op ran inside the wrapper's call

struct Quiet : c10::WarningHandler {
  // Registering over an op's own kernel at the key warns once; fadiag's log says it.
  void process(const c10::Warning& /*warning*/) override {}
};

// The keys a call is handed on to from the tap's: the backend's.
constexpr c10::DispatchKeySet kBelow =
    c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);

// Whether a call the tap hands on reaches a backend the tap times (CPU, CUDA), not a tracer's
// kernel (fake or meta tensors, a Python mode) or another device's (an NPU's fused ops are the
// Python interceptors' to measure: tap.py's KEYS).
inline bool reaches_backend(c10::DispatchKeySet below) {
  const c10::DispatchKey k = below.highestPriorityTypeId();
  return k == c10::DispatchKey::CPU || k == c10::DispatchKey::CUDA;
}

class TapState {
 public:
  TapState(std::shared_ptr<Pool> cpu, std::shared_ptr<Pool> cuda, int64_t max_records)
      : cpu_(std::move(cpu)), cuda_(std::move(cuda)), max_records_(max_records) {}

  std::vector<Spec> specs;

  // One call of op `i`, with `args` its arguments' views: `run()` calls what the tap wraps and
  // returns its results, `results(out)` views them. The op's own errors pass through.
  template <class Run, class Results>
  auto call(int64_t i, c10::ArrayRef<Arg> args, Run&& run, Results&& results) {
    if (t_depth > 0) return run();  // an op a tapped op calls (flash's _flash_attention_forward)
    ++t_depth;
    struct Leave {
      ~Leave() { --t_depth; }
    } leave;
    const Spec& s = specs[static_cast<size_t>(i)];
    return s.backward ? backward(s, args, run) : forward(s, args, run, results);
  }

  void set_measuring(bool on) { measuring_.store(on, std::memory_order_relaxed); }

  // Every record since the last cut, moved out (a swap: the training thread's part of a drain).
  std::vector<Record> cut() {
    std::lock_guard<std::mutex> lock(mu_);
    return cut_locked();
  }

  // A quiet step's cut (QuietSteps): taken only where the records are `calls` calls none of the
  // wrapper's (no link), something trained, and nothing was counted since `counted` (counted()),
  // as the Python boundary's cut would be closed as a matching bypassed step; else nothing is cut.
  std::optional<std::vector<Record>> cut_if_quiet(int64_t calls, int64_t counted_before) {
    std::lock_guard<std::mutex> lock(mu_);
    if (calls <= 0 || static_cast<int64_t>(records_.size()) != calls ||
        counted() != counted_before) {
      return std::nullopt;
    }
    bool trained = false;
    for (const Record& r : records_) {
      if (r.link != 0) return std::nullopt;
      trained = trained || r.b0 >= 0 || r.recompute;
    }
    if (!trained) return std::nullopt;
    return cut_locked();
  }

  // A step boundary's reset of the pools' backward state (NativeTimer.reset_in_backward).
  void reset_in_backward() {
    if (cpu_ != nullptr) cpu_->reset_in_backward();
    if (cuda_ != nullptr) cuda_->reset_in_backward();
  }

  Pool* pool_of(const Record& r) const { return r.cuda ? cuda_.get() : cpu_.get(); }

  // Every mark of `records` given back, one lock of each pool's free list, and the records
  // dropped: a cut counted, or one that will not be resolved.
  void release(std::vector<Record>& records) {
    std::vector<int64_t> slots[2];  // the CPU pool's, the CUDA pool's
    for (const Record& r : records) {
      for (int64_t slot : {r.f0, r.f1, r.b0, r.b1}) slots[r.cuda ? 1 : 0].push_back(slot);
    }
    if (cpu_ != nullptr) cpu_->give_back_all(slots[0]);
    if (cuda_ != nullptr) cuda_->give_back_all(slots[1]);
    records.clear();
  }

  // Compiled code's records (no link; `linked`: every record) as tuples (see Tap._compiled in
  // fadiag/capture/tap.py, and capture/order.py, which learns an order from a step's linked
  // ones), on the resolver thread.
  static py::list rows(const std::vector<Record>& records, bool linked) {
    py::list out;
    for (const Record& r : records) {
      if (r.link != 0 && !linked) continue;
      py::object dtype = py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(r.dtype)));
      out.append(py::make_tuple(
          r.op, r.f0, r.f1, r.b0 < 0 ? py::object(py::none()) : py::object(py::int_(r.b0)),
          r.b1 < 0 ? py::object(py::none()) : py::object(py::int_(r.b1)),
          py::make_tuple(r.b, r.h, r.sq, r.sk, r.d), r.dv, r.kv_heads, dtype,
          c10::DeviceTypeName(r.device_type, /*lower_case=*/true), r.device_index, r.causal,
          r.dropout, r.scale, r.recompute, r.phase,
          r.kept < 0 ? py::object(py::none()) : py::object(py::int_(r.kept)), r.cuda, r.link,
          r.graph_backward));
    }
    return out;
  }

  // The wrapper's records (linked) as what its calls need of them: (link, forward start, forward
  // end, backward start, backward end, cuda, graph_backward), a backward mark None where none
  // was taken. The wrapper knows the rest (Tap.calls).
  static py::list links(const std::vector<Record>& records) {
    py::list out;
    for (const Record& r : records) {
      if (r.link == 0) continue;
      out.append(py::make_tuple(
          r.link, r.f0, r.f1, r.b0 < 0 ? py::object(py::none()) : py::object(py::int_(r.b0)),
          r.b1 < 0 ? py::object(py::none()) : py::object(py::int_(r.b1)), r.cuda,
          r.graph_backward));
    }
    return out;
  }

  // The steady-clock time of the oldest record whose marks the device has not passed, or -1:
  // for the hang check, which cannot see calls before the resolver has them.
  int64_t oldest_open_ns() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t oldest = -1;
    for (const Record& r : records_) {
      Pool* pool = r.cuda ? cuda_.get() : cpu_.get();
      if (pool == nullptr) continue;
      const bool open = !pool->done(r.f1) || (r.b1 >= 0 && !pool->done(r.b1));
      if (open && (oldest < 0 || r.host_ns < oldest)) oldest = r.host_ns;
    }
    return oldest;
  }

  // The sum of the reasons counted (not backwards, not errors): unchanged means none moved, so
  // the training thread's step boundary reads one integer where nothing was lost.
  int64_t counted() const {
    return sampled_.load() + over_cap_.load() + captured_.load() + unpaired_.load() +
           other_device_.load() + unreadable_.load();
  }

  py::dict counts() const {
    py::dict d;
    d["sampling"] = sampled_.load();
    d["per_step_cap"] = over_cap_.load();
    d["captured"] = captured_.load();
    d["unpaired_backward"] = unpaired_.load();
    d["other_device"] = other_device_.load();
    d["unreadable"] = unreadable_.load();
    d["errors"] = errors_.load();
    d["backwards"] = backwards_.load();
    return d;
  }

 private:
  struct Ptr {
    const void* out = nullptr;
    const void* lse = nullptr;
  };

  static const void* ptr_of(const Arg& a) {
    if (!a.is_tensor()) return nullptr;
    const at::Tensor& t = a.t();
    return t.numel() > 0 ? t.data_ptr() : nullptr;
  }

  static Ptr ptrs(const Spec& s, c10::ArrayRef<Arg> results) {
    const auto at = [&](int64_t i) {
      return i >= 0 && i < static_cast<int64_t>(results.size()) ? ptr_of(results[i]) : nullptr;
    };
    return Ptr{at(s.out), at(s.lse)};
  }

  // The pool whose marks time a call on `type`; null for a device the tap does not time.
  Pool* pool_for(c10::DeviceType type) const {
    if (type == c10::DeviceType::CPU) return cpu_.get();
    if (type == c10::DeviceType::CUDA) return cuda_.get();
    return nullptr;
  }

  // `run()` between two marks: (start, end); the host time the window may hold is read from the
  // two slots with its seconds (Pool::held_host_ns). The op's own error passes through, its
  // start mark given back.
  template <class Run>
  static auto timed(Pool* pool, Run& run, int64_t& start, int64_t& end) {
    start = pool->take_marked(/*capture_checked=*/true);
    try {
      auto out = run();
      end = pool->take_marked(/*capture_checked=*/true, /*since=*/start);
      return out;
    } catch (...) {
      pool->give_back(start);
      throw;
    }
  }

  // Shape, dtype and flags from the arguments; false when they cannot be read.
  static bool read(const Spec& s, c10::ArrayRef<Arg> args, Record& r) {
    if (!args[s.q].is_tensor() || !args[s.k].is_tensor() || !args[s.v].is_tensor()) return false;
    const at::Tensor& q = args[s.q].t();
    const at::Tensor& k = args[s.k].t();
    const at::Tensor& v = args[s.v].t();
    if (q.is_nested() || q.dim() != k.dim() || q.dim() != v.dim()) return false;
    if (s.bshd && q.dim() == 3) {  // packed sequences: (total tokens, heads, head dim)
      if (s.cu_q < 0 || !args[s.cu_q].is_tensor()) return false;
      r.b = args[s.cu_q].t().numel() - 1;
      r.h = q.size(1);
      r.d = q.size(2);
      r.sq = s.max_q >= 0 && args[s.max_q].kind == Arg::kInt ? args[s.max_q].integer : q.size(0);
      r.sk = s.max_k >= 0 && args[s.max_k].kind == Arg::kInt ? args[s.max_k].integer : k.size(0);
      r.kv_heads = k.size(1);
      r.dv = v.size(2);
    } else if (q.dim() == 4) {  // (B, H, S, D), or (B, S, H, D)
      const int64_t seq = s.bshd ? 1 : 2, heads = s.bshd ? 2 : 1;
      r.b = q.size(0);
      r.h = q.size(heads);
      r.sq = q.size(seq);
      r.d = q.size(3);
      r.sk = k.size(seq);
      r.kv_heads = k.size(heads);
      r.dv = v.size(3);
    } else {
      return false;
    }
    r.dtype = q.scalar_type();
    r.device_type = q.device().type();
    r.device_index = q.device().index();
    if (s.causal >= 0) {  // a flag, or efficient's mask type (0: none)
      const Arg& c = args[s.causal];
      r.causal = (c.kind == Arg::kBool || c.kind == Arg::kInt) && c.integer != 0;
    }
    if (s.dropout >= 0 && args[s.dropout].kind == Arg::kDouble) r.dropout = args[s.dropout].number;
    if (s.scale >= 0 && args[s.scale].kind == Arg::kDouble) r.scale = args[s.scale].number;
    return true;
  }

  // Whether to time a forward, and the record it starts (read from `args`); false leaves it
  // unmeasured (and counted, where that is a reason).
  bool plan(const Spec& s, c10::ArrayRef<Arg> args, Record& r, Pool*& pool) {
    try {
      if (t_python > 0) t_seen = true;
      r.link = t_link;
      t_link = 0;  // one fused forward per wrapped call; anything after it passes through
      if (t_python > 0 && r.link == 0) return false;  // Python's own call: it times it
      if (r.link == 0 && !measuring_.load(std::memory_order_relaxed)) {
        sampled_.fetch_add(1);
      } else if (!read(s, args, r)) {
        unreadable_.fetch_add(1);
      } else if ((pool = pool_for(r.device_type)) == nullptr) {
        other_device_.fetch_add(1);
      } else {
        return true;
      }
    } catch (...) {
      errors_.fetch_add(1);
    }
    return false;
  }

  template <class Run, class Results>
  auto forward(const Spec& s, c10::ArrayRef<Arg> args, Run& run, Results& results) {
    Record r;
    Pool* pool = nullptr;
    const bool measure = plan(s, args, r, pool);
    r.op = s.op;
    r.cuda = r.device_type == c10::DeviceType::CUDA;
#ifdef FADIAG_CUDA
    // Marks go on the current stream of the inputs' device, where the op's kernels are queued.
    std::optional<c10::cuda::CUDAGuard> guard;
    if (measure && r.cuda) guard.emplace(static_cast<c10::DeviceIndex>(r.device_index));
    // A stream a CUDA graph captures (of the device the guard made current) takes no mark: the
    // op counts as captured, per replay (by Python: torch.cuda.CUDAGraph.replay).
    const bool captured = measure && r.cuda && pool->capturing();
    if (captured) captured_.fetch_add(1);
#else
    const bool captured = false;
#endif
    if (!measure || captured) {
      auto out = run();
      remember(s, results(out), kUnmeasured);
      return out;
    }
    r.recompute = torch::autograd::get_current_graph_task_id() != -1;
    r.host_ns = steady_ns();
    auto out = timed(pool, run, r.f0, r.f1);
    keep(s, r, pool, results(out));
    return out;
  }

  // A measured forward's record, into the log.
  void keep(const Spec& s, const Record& r, Pool* pool, c10::ArrayRef<Arg> results) {
    try {
      const Ptr p = ptrs(s, results);
      std::lock_guard<std::mutex> lock(mu_);
      if (static_cast<int64_t>(records_.size()) >= max_records_) {
        over_cap_.fetch_add(1);
        pool->give_back(r.f0);
        pool->give_back(r.f1);
        return;
      }
      if (backward_since_forward_ && !r.recompute) {
        ++phase_;  // a forward after a backward: the next micro-batch
        backward_since_forward_ = false;
      }
      const int64_t id = next_id_++;
      records_.push_back(r);
      records_.back().phase = phase_;
      ++waiting_;
      pair(p, id);
    } catch (...) {
      errors_.fetch_add(1);
    }
  }

  void remember(const Spec& s, c10::ArrayRef<Arg> results, int64_t id) {
    try {
      const Ptr p = ptrs(s, results);
      std::lock_guard<std::mutex> lock(mu_);
      pair(p, id);
    } catch (...) {
      errors_.fetch_add(1);
    }
  }

  // Under mu_. Entries live until the next drain; a process that never ends a step (inference
  // with no optimizer) must not grow them without bound, so past kMaxPairs they start over.
  void pair(const Ptr& p, int64_t id) {
    if (by_ptr_.size() >= kMaxPairs) by_ptr_.clear();
    if (p.lse != nullptr) by_ptr_[p.lse] = id;
    if (p.out != nullptr) by_ptr_[p.out] = id;
  }

  // Bytes of what the forward kept for this backward: the arguments Python named as such,
  // each storage once, none shared with q, k or v.
  static int64_t kept_bytes(const Spec& s, c10::ArrayRef<Arg> args) {
    std::vector<const void*> seen;
    for (int64_t i : {s.q, s.k, s.v}) {
      if (args[i].is_tensor()) seen.push_back(args[i].t().storage().data());
    }
    int64_t total = 0;
    for (int64_t i : s.kept) {
      if (!args[i].is_tensor()) continue;
      const at::Tensor& t = args[i].t();
      if (!t.has_storage()) continue;
      const void* data = t.storage().data();
      bool dup = false;
      for (const void* p : seen) dup = dup || p == data;
      if (dup) continue;
      seen.push_back(data);
      total += static_cast<int64_t>(t.storage().nbytes());
    }
    return total;
  }

  // Under mu_: whether record `id` is in the log and has no backward yet.
  bool waiting(int64_t id) const {
    const int64_t index = id - first_id_;
    if (index < 0 || index >= static_cast<int64_t>(records_.size())) return false;
    const Record& r = records_[static_cast<size_t>(index)];
    return r.b0 < 0 && !r.graph_backward;
  }

  // The forward record a backward op's arguments name (or kUnmeasured, or -1: none), with what
  // it kept and the pool to time the backward on; id < 0 or no pool: not timed.
  struct Pairing {
    int64_t id = -1;
    int64_t kept = -1;
    Pool* pool = nullptr;
    bool cuda = false;
    c10::DeviceIndex device = -1;
  };

  Pairing pairing(const Spec& s, c10::ArrayRef<Arg> args) {
    Pairing p;
    try {
      const void* lse = s.lse >= 0 ? ptr_of(args[s.lse]) : nullptr;
      const void* out = s.out >= 0 ? ptr_of(args[s.out]) : nullptr;
      {
        // The forward still waiting for its backward that either tensor names, the latest if
        // they name two. An address can be one a freed tensor of an earlier forward had: under
        // checkpointing the first pass's outputs are freed (that pass never gets a backward) and
        // the backward receives the recomputation's (seen on CPU, compiled: layer 1's backward
        // named the first pass's layer 0, which the older rule, the first waiting forward found,
        // took); or the logsumexp of a layer recomputed before, whose backward ran already.
        std::lock_guard<std::mutex> lock(mu_);
        for (const void* key : {lse, out}) {
          auto found = key != nullptr ? by_ptr_.find(key) : by_ptr_.end();
          if (found == by_ptr_.end()) continue;
          const int64_t candidate = found->second;
          if (candidate >= 0 && waiting(candidate)) {
            if (p.id < 0 || !waiting(p.id) || candidate > p.id) p.id = candidate;
          } else if (p.id == -1) {
            p.id = candidate;  // kUnmeasured, or a forward that has its backward
          }
        }
        if (p.id != -1) backward_since_forward_ = true;
      }
      if (p.id == -1) unpaired_.fetch_add(1);
      if (p.id >= 0 && args[s.q].is_tensor()) {
        const at::Tensor& q = args[s.q].t();
        p.pool = pool_for(q.device().type());
        p.cuda = q.is_cuda();
        p.device = q.device().index();
        p.kept = kept_bytes(s, args);
      }
    } catch (...) {
      errors_.fetch_add(1);
      p.id = -1;
    }
    return p;
  }

  template <class Run>
  auto backward(const Spec& s, c10::ArrayRef<Arg> args, Run& run) {
    const Pairing p = pairing(s, args);
    if (p.id < 0 || p.pool == nullptr) return run();
#ifdef FADIAG_CUDA
    std::optional<c10::cuda::CUDAGuard> guard;
    if (p.cuda) {
      guard.emplace(p.device);
      // A backward captured into a CUDA graph (its forward measured outside one): a timing
      // event recorded while the stream captures would fail, and invalidate the capture. The
      // op counts as captured (per replay, as a captured forward does), and its forward's
      // record says so: the call is reported unmeasured, not with a backward of 0.
      if (p.pool->capturing()) {  // the current stream of the device the guard made current
        captured_.fetch_add(1);
        std::lock_guard<std::mutex> lock(mu_);
        if (waiting(p.id)) {
          records_[static_cast<size_t>(p.id - first_id_)].graph_backward = true;
          awaited(p.pool);
        }
        return run();
      }
    }
#endif
    backwards_.fetch_add(1);
    p.pool->backward_seen();  // a backward ran: the recorder's next forward starts a micro-batch
    p.pool->tap_window(true);
    int64_t b0 = -1, b1 = -1;
    auto out = timed(p.pool, run, b0, b1);
    std::lock_guard<std::mutex> lock(mu_);
    if (waiting(p.id)) {
      Record& r = records_[static_cast<size_t>(p.id - first_id_)];
      r.b0 = b0;
      r.b1 = b1;
      r.kept = p.kept;
      awaited(p.pool);
    } else {  // drained already, or a second backward through a retained graph
      unpaired_.fetch_add(1);
      p.pool->give_back(b0);
      p.pool->give_back(b1);
    }
    return out;
  }

  // Under mu_: a record no longer waits for its backward. After the pass's last, the backward
  // window the tap opened (Pool::tap_window) shuts.
  void awaited(Pool* pool) {
    if (--waiting_ <= 0) pool->tap_window(false);
  }

  std::vector<Record> cut_locked() {
    std::vector<Record> records;
    records.swap(records_);
    first_id_ = next_id_;
    by_ptr_.clear();
    phase_ = 0;
    backward_since_forward_ = false;
    waiting_ = 0;
    return records;
  }

  std::shared_ptr<Pool> cpu_, cuda_;
  int64_t max_records_;
  std::atomic<bool> measuring_{true};
  std::mutex mu_;
  std::vector<Record> records_;
  std::unordered_map<const void*, int64_t> by_ptr_;
  int64_t next_id_ = 0, first_id_ = 0, phase_ = 0;
  int64_t waiting_ = 0;  // records in the log with no backward yet
  bool backward_since_forward_ = false;
  std::atomic<int64_t> sampled_{0}, over_cap_{0}, captured_{0}, unpaired_{0}, other_device_{0},
      unreadable_{0}, errors_{0}, backwards_{0};
};

// One cut of the record log, handed from the training thread to the resolver.
struct Batch {
  std::vector<Record> records;

  // Records of calls that were not the eager wrapper's (no link).
  int64_t unlinked() const {
    int64_t n = 0;
    for (const Record& r : records) n += r.link == 0 ? 1 : 0;
    return n;
  }

  // Whether anything in it trained: a backward ran, a recomputation, or a wrapped call.
  bool trained() const {
    for (const Record& r : records) {
      if (r.b0 >= 0 || r.recompute || r.link != 0) return true;
    }
    return false;
  }
};

// A batch's shape: everything that decides which call each record becomes and under which key it
// is counted (op, pass, recomputation, linked or not, backward taken, device), hashed (FNV-1a).
// Two batches of one shape turn into the same calls in the same order (Tap._compiled in
// fadiag/capture/tap.py names compiled records by their pass and order).
uint64_t shape_of(const Batch& b) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](int64_t v) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ull;
  };
  mix(static_cast<int64_t>(b.records.size()));
  for (const Record& r : b.records) {
    mix(r.op);
    mix(r.phase);
    mix((r.recompute ? 1 : 0) | (r.link != 0 ? 2 : 0) | (r.b0 >= 0 ? 4 : 0) |
        (r.graph_backward ? 8 : 0) | (r.cuda ? 16 : 0));
    mix(r.device_index);
  }
  return h;
}

// Steady steps counted with no Python per call (sampling.reports_per_second; the resolver's side
// is fadiag/steps/steady.py). A step shaped like one Python resolved has its records' seconds read
// and summed here as Metrics.count sums a counted step's rows (fadiag/export/prometheus.py): per
// key (impl, site), a forward histogram and the calls (recomputations not), a backward histogram
// (backwards that ran), the host-bound calls; per step, its attention seconds. `take` hands the
// sums to Python and starts again.
class Tally {
 public:
  Tally(std::vector<double> bounds, double host_share)
      : bounds_(std::move(bounds)), share_(host_share), step_(bounds_.size() + 1) {}

  // 1: counted, and every mark of the batch given back; 0: a mark the device has not passed yet
  // (nothing changed); -1: not a steady step after all (a failed mark, a backward refused in a
  // graph capture): nothing changed, Python resolves it. `keys`, `recompute`: per record, its
  // key's index and whether its call is a recomputation. The marks are read without the GIL.
  int count(TapState& state, Batch& batch, const std::vector<int64_t>& keys,
            const std::vector<bool>& recompute, bool give_up_open_backward) {
    py::gil_scoped_release no_gil;
    return count_one(state, batch, keys, recompute, give_up_open_backward);
  }

  // Steady steps in a row, counted as `count` counts each, for one release of the GIL: a run of
  // steps with no call of the eager wrapper's (bypassed or compiled ones), each cut shaped as
  // `shape` with no linked record. (counted, why the next was not): counted ones are consumed
  // (their records emptied, their marks given back), and the next reads 0 (a mark the device has
  // not passed), -1 (Python's: not shaped so, or as `count`'s -1) or 1 (the run was all counted).
  std::pair<int64_t, int> count_run(TapState& state, const std::vector<Batch*>& batches,
                                    int64_t shape, const std::vector<int64_t>& keys,
                                    const std::vector<bool>& recompute,
                                    const std::vector<bool>& give_up_open_backward) {
    if (give_up_open_backward.size() != batches.size()) return {0, -1};
    py::gil_scoped_release no_gil;
    int64_t counted = 0;
    for (size_t i = 0; i < batches.size(); ++i) {
      Batch& batch = *batches[i];
      if (static_cast<int64_t>(shape_of(batch)) != shape) return {counted, -1};
      for (const Record& r : batch.records) {
        if (r.link != 0) return {counted, -1};
      }
      const int done = count_one(state, batch, keys, recompute, give_up_open_backward[i]);
      if (done != 1) return {counted, done};
      ++counted;
    }
    return {counted, 1};
  }

  // What was counted since the last take, or None: (steps, the step histogram's counts, its sum,
  // [(key, forward counts, forward sum, calls, backward counts, backward sum, host-bound calls)]).
  py::object take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (steps_ == 0) return py::none();
    py::list keys;
    for (size_t i = 0; i < keys_.size(); ++i) {
      Key& k = keys_[i];
      if (!k.touched) continue;
      keys.append(py::make_tuple(static_cast<int64_t>(i), k.fwd.counts, k.fwd.sum, k.calls,
                                 k.bwd.counts, k.bwd.sum, k.host_bound));
      k = Key(bounds_.size() + 1);
    }
    py::tuple out = py::make_tuple(steps_, step_.counts, step_.sum, keys);
    steps_ = 0;
    step_ = Hist(bounds_.size() + 1);
    return out;
  }

 private:
  // Tally::count without the GIL (its caller released it).
  int count_one(TapState& state, Batch& batch, const std::vector<int64_t>& keys,
                const std::vector<bool>& recompute, bool give_up_open_backward) {
    const std::vector<Record>& rs = batch.records;
    if (rs.empty() || keys.size() != rs.size() || recompute.size() != rs.size()) return -1;
    std::vector<double> s(4 * rs.size(), 0.0);  // per record, as Pool::read_call reads it
    for (size_t i = 0; i < rs.size(); ++i) {
      const Record& r = rs[i];
      Pool* pool = state.pool_of(r);
      if (pool == nullptr) return -1;
      if (!pool->read_call(r.f0, r.f1, r.b0, r.b1, give_up_open_backward, &s[4 * i])) return 0;
      // A failed forward mark, a backward refused in a graph capture: Python's to count.
      if (std::isnan(s[4 * i]) || s[4 * i + 1] < 0.0) return -1;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      double forward = 0.0, backward = 0.0;
      for (size_t i = 0; i < rs.size(); ++i) {
        const double f = finite(s[4 * i]), b = finite(s[4 * i + 1]);
        Key& k = key(keys[i]);
        k.touched = true;
        if (!recompute[i]) {
          observe(k.fwd, f);
          k.calls += 1;
          forward += f;
        }
        if (s[4 * i + 2] * 1e-9 > share_ * f || s[4 * i + 3] * 1e-9 > share_ * b) k.host_bound += 1;
        if (b > 0.0) observe(k.bwd, b);
        backward += b;
      }
      observe(step_, forward + backward);
      steps_ += 1;
    }
    state.release(batch.records);
    return 1;
  }

  struct Hist {
    explicit Hist(size_t n) : counts(n, 0) {}
    std::vector<int64_t> counts;
    double sum = 0.0;
  };
  struct Key {
    explicit Key(size_t n) : fwd(n), bwd(n) {}
    Hist fwd, bwd;
    int64_t calls = 0, host_bound = 0;
    bool touched = false;
  };

  // Timings that are not a finite non-negative number count as 0 (steps/counting.py).
  static double finite(double x) { return std::isfinite(x) && x >= 0.0 ? x : 0.0; }

  // As bisect.bisect_left over the bounds: the first bucket whose bound is >= v.
  void observe(Hist& h, double v) {
    h.counts[static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                 bounds_.begin())] += 1;
    h.sum += v;
  }

  Key& key(int64_t i) {
    const auto at = static_cast<size_t>(std::max<int64_t>(i, 0));
    while (keys_.size() <= at) keys_.emplace_back(bounds_.size() + 1);
    return keys_[at];
  }

  std::vector<double> bounds_;
  double share_;
  std::mutex mu_;
  std::vector<Key> keys_;
  Hist step_;
  int64_t steps_ = 0;
};

// aten's ops, typed: the call stays unboxed from the caller through the tap to the backend.
// Each kernel's C++ signature is the op's own in this torch's headers (at::_ops::<op>::schema),
// so the registration matches whatever schema this torch version gives the op.
template <class Op, class Schema = typename Op::schema>
struct Typed;

template <class Op, class Ret, class... A>
struct Typed<Op, Ret(A...)> {
  static torch::CppFunction kernel(std::shared_ptr<TapState> state, int64_t index) {
    return torch::CppFunction([state = std::move(state), index](c10::DispatchKeySet ks,
                                                                A... args) -> Ret {
      const c10::DispatchKeySet below = ks & kBelow;
      auto run = [&]() -> Ret { return Op::redispatch(below, args...); };
      if (!reaches_backend(below)) return run();
      const auto results = [](const Ret& out) { return views_of(out); };
      return state->call(index, views(args...), run, results);
    });
  }
};

using TypedMaker = torch::CppFunction (*)(std::shared_ptr<TapState>, int64_t);

template <class Op>
std::pair<std::string, TypedMaker> typed() {
  return {Op::name, &Typed<Op>::kernel};
}

// The aten ops this torch has, by qualified name (an op added in a later torch is left out).
const std::map<std::string, TypedMaker>& typed_ops() {
  static const std::map<std::string, TypedMaker> ops = {
      typed<at::_ops::_scaled_dot_product_flash_attention>(),
      typed<at::_ops::_scaled_dot_product_flash_attention_backward>(),
      typed<at::_ops::_scaled_dot_product_efficient_attention>(),
      typed<at::_ops::_scaled_dot_product_efficient_attention_backward>(),
      typed<at::_ops::_scaled_dot_product_flash_attention_for_cpu>(),
      typed<at::_ops::_scaled_dot_product_flash_attention_for_cpu_backward>(),
      typed<at::_ops::_flash_attention_forward>(),
      typed<at::_ops::_flash_attention_backward>(),
      typed<at::_ops::_efficient_attention_forward>(),
      typed<at::_ops::_efficient_attention_backward>(),
#ifdef FADIAG_CUDNN_ATTENTION
      typed<at::_ops::_scaled_dot_product_cudnn_attention>(),
      typed<at::_ops::_scaled_dot_product_cudnn_attention_backward>(),
#endif
  };
  return ops;
}

// Any other op (flash_attn's, registered from Python), boxed: its arguments read from the stack.
// `original`: the op's own kernel at the tap's key, which the tap calls, where it has one.
class Boxed final : public c10::OperatorKernel {
 public:
  Boxed(std::shared_ptr<TapState> state, int64_t index,
        std::optional<c10::SafeKernelFunction> original)
      : state_(std::move(state)), index_(index), original_(std::move(original)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below = ks & kBelow;
    auto run = [&] {
      if (original_) {
        original_->callBoxed(op, ks, stack);
      } else {
        op.redispatchBoxed(below, stack);
      }
      return true;
    };
    if (!reaches_backend(below)) {
      run();
      return;
    }
    const std::vector<Arg> args = views_of_stack(*stack, op.schema().arguments().size());
    const size_t nrets = op.schema().returns().size();
    // The arguments' views are read before `run` pops them; the results' after it pushed them.
    const auto results = [&](bool) { return views_of_stack(*stack, nrets); };
    state_->call(index_, args, run, results);
  }

 private:
  std::shared_ptr<TapState> state_;
  int64_t index_;
  std::optional<c10::SafeKernelFunction> original_;
};

int64_t get(const py::dict& d, const char* key, int64_t fallback) {
  return d.contains(key) ? d[key].cast<int64_t>() : fallback;
}

// Steps QuietSteps closed, handed to Python as one object (fadiag/steps/quiet.py's QuietRun):
// their cuts and when each closed (time.monotonic, time.time), taken from the head by the
// resolver: counted in C++ (Tap::count_quiet) or one at a time as a TapBatch (`split`). No
// Python object a step on the training thread.
struct QuietBatches {
  std::vector<Batch> batches;
  std::vector<double> closed, wall;
  size_t head = 0;
  size_t size() const { return batches.size() - head; }
};

// Steady bypassed eager steps closed at the optimizer's step with no Python
// (fadiag/steps/quiet.py): the recorder's optimizer hook. Armed by the step boundary's Python for
// the steps that may still be bypassed before one verifies the order, it closes each step the
// Python boundary would close as a bypassed step matching its order with nothing else to do: no
// call of the wrapper's, nothing pending or counted, the same unbroken order, the builtins' calls
// all the tap's records (and something trained: TapState::cut_if_quiet). Such a step's cut is
// kept here, with its times; anything else disarms it and the step goes to `fallback` (the Python
// boundary), which first takes the steps closed here (`take`) and hands them over in order. What
// it reads of the recorder, the tap and the order are Python attributes, under the GIL, where the
// boundary reads them; nothing thrown here reaches the optimizer.
class QuietSteps {
 public:
  QuietSteps(std::shared_ptr<TapState> state, py::object recorder, py::object tap,
             py::object fallback)
      : state_(std::move(state)), rec_(std::move(recorder)), tap_(std::move(tap)),
        fallback_(std::move(fallback)) {}

  // The optimizer's step ended: closed here, or by `fallback`.
  void step() {
    bool closed = false;
    if (armed_) {
      try {
        closed = close();
      } catch (...) {  // a Python attribute that could not be read: the boundary's to see
        errors_ += 1;
      }
      if (!closed) armed_ = false;
    }
    if (!closed) fallback_();
  }

  // The next `budget` steps may be closed here if each is as described above: `order` names them,
  // the builtins' calls stood at `seen`, the tap's CUDA graph calls at `graph_calls`, the
  // recorder's own unmeasured calls at `unmeasured` (and the tap's counted() as it is now); for
  // `cap_s` at most once one is closed (the first always is).
  void arm(py::object order, int64_t budget, int64_t seen, int64_t graph_calls,
           int64_t unmeasured, double cap_s) {
    order_ = std::move(order);
    budget_ = budget;
    seen_ = seen;
    counted_ = state_->counted();
    graph_calls_ = graph_calls;
    unmeasured_ = unmeasured;
    until_ns_ = steady_ns() + static_cast<int64_t>(cap_s * 1e9);
    armed_ = budget > 0;
  }

  void disarm() { armed_ = false; }
  bool armed() const { return armed_; }

  // The steps closed here since the last take, in order, as one QuietBatches (None: none); and
  // the builtins' calls counted at the last (Bypass's `seen`). Disarms.
  py::tuple take() {
    armed_ = false;
    if (run_.batches.empty()) return py::make_tuple(py::none(), seen_);
    py::object run = py::cast(std::move(run_));
    run_ = QuietBatches{};
    return py::make_tuple(run, seen_);
  }

  int64_t closed() const { return closed_; }
  int64_t errors() const { return errors_; }

 private:
  bool close() {
    if (budget_ <= 0 || (!run_.batches.empty() && steady_ns() > until_ns_)) return false;
    if (rec_.attr(since_boundary_name_).cast<int64_t>() != 0 ||
        py::len(rec_.attr(calls_name_)) != 0 || !rec_.attr(pending_name_).is_none()) {
      return false;
    }
    const py::object order = tap_.attr(order_name_);
    if (!order.is(order_) || py::cast<bool>(order_.attr(broken_name_)) ||
        tap_.attr(graph_calls_name_).cast<int64_t>() != graph_calls_) {
      return false;
    }
    int64_t unmeasured = 0;
    const py::dict counts = rec_.attr(unmeasured_name_);
    for (auto item : counts) unmeasured += item.second.cast<int64_t>();
    if (unmeasured != unmeasured_) return false;
    const int64_t total = eager_bypassed();
    std::optional<std::vector<Record>> records = state_->cut_if_quiet(total - seen_, counted_);
    if (!records) return false;
    seen_ = total;
    budget_ -= 1;
    closed_ += 1;
    state_->reset_in_backward();
    const auto wall = std::chrono::system_clock::now().time_since_epoch();
    run_.batches.push_back(Batch{std::move(*records)});
    run_.closed.push_back(static_cast<double>(steady_ns()) * 1e-9);
    run_.wall.push_back(std::chrono::duration<double>(wall).count());
    return true;
  }

  std::shared_ptr<TapState> state_;
  py::object rec_, tap_, fallback_, order_;
  bool armed_ = false;
  int64_t budget_ = 0, seen_ = 0, counted_ = 0, graph_calls_ = 0, unmeasured_ = 0;
  int64_t until_ns_ = 0, closed_ = 0, errors_ = 0;
  QuietBatches run_;
  // The attributes read each step, named once (as EagerWrapper and FastBegin name theirs).
  py::str since_boundary_name_{"calls_since_boundary"}, calls_name_{"calls"},
      pending_name_{"pending"}, unmeasured_name_{"unmeasured"}, order_name_{"order"},
      broken_name_{"broken"}, graph_calls_name_{"cuda_graph_calls"};
};

class Tap {
 public:
  Tap(std::shared_ptr<Pool> cpu, std::shared_ptr<Pool> cuda, int64_t max_records)
      : state_(std::make_shared<TapState>(std::move(cpu), std::move(cuda), max_records)) {}

  ~Tap() { uninstall(); }

  // A kernel at BackendSelect for each op. `specs`: one dict per op, from fadiag/capture/tap_ops.py.
  // Returns, per op, how it is tapped: "typed", "boxed" or "wrapped" (its own kernel there called).
  std::vector<std::string> install(const std::vector<py::dict>& specs) {
    TORCH_CHECK(libraries_.empty(), "fadiag tap: already installed");
    std::vector<Spec> parsed;
    for (const py::dict& d : specs) {
      Spec s;
      s.name = d["name"].cast<std::string>();
      s.overload = d["overload"].cast<std::string>();
      s.op = get(d, "op", 0);
      s.backward = d["backward"].cast<bool>();
      s.bshd = d["bshd"].cast<bool>();
      s.q = get(d, "q", 0), s.k = get(d, "k", 1), s.v = get(d, "v", 2);
      s.causal = get(d, "causal", -1), s.dropout = get(d, "dropout", -1);
      s.scale = get(d, "scale", -1), s.cu_q = get(d, "cu_q", -1);
      s.max_q = get(d, "max_q", -1), s.max_k = get(d, "max_k", -1);
      s.out = get(d, "out", 0), s.lse = get(d, "lse", 1);
      if (d.contains("kept")) s.kept = d["kept"].cast<std::vector<int64_t>>();
      parsed.push_back(std::move(s));
    }
    state_->specs = parsed;
    std::vector<std::string> how;
    Quiet quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    try {
      for (size_t i = 0; i < parsed.size(); ++i) {
        const Spec& s = parsed[i];
        const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(s.name.c_str(),
                                                                           s.overload.c_str());
        const auto sep = s.name.find("::");
        const std::string ns = s.name.substr(0, sep);
        std::string op = s.name.substr(sep + 2);
        if (!s.overload.empty()) op += "." + s.overload;
        auto& lib = libraries_[ns];
        if (!lib) {
          lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, kKey, __FILE__,
                                                 static_cast<uint32_t>(__LINE__));
        }
        const auto index = static_cast<int64_t>(i);
        const auto typed = typed_ops().find(s.name);
        if (typed != typed_ops().end() && s.overload.empty()) {
          lib->impl(op.c_str(), typed->second(state_, index));
          how.emplace_back("typed");
          continue;
        }
        std::optional<c10::SafeKernelFunction> original;
        if (handle.hasKernelForDispatchKey(kKey)) {
          original.emplace(handle.getComputedKernelForDispatchKey(kKey));
        }
        how.emplace_back(original ? "wrapped" : "boxed");
        lib->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<Boxed>(state_, index, std::move(original))));
      }
    } catch (...) {
      libraries_.clear();
      throw;
    }
    return how;
  }

  // Every op is left as it was: nothing at BackendSelect (the dispatcher skips the key again), or
  // its own kernel there, current again.
  void uninstall() {
    Quiet quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    libraries_.clear();
  }

  bool installed() const { return !libraries_.empty(); }
  void set_measuring(bool on) { state_->set_measuring(on); }
  // A step boundary's cut, with what the boundary reads of it and beside it, in one call from
  // the training thread (each C++ call right after the optimizer's step runs cold): (the batch,
  // None when empty; its unlinked records; whether anything in it trained; counted(); the calls
  // SDPA's builtins passed on while bypassing, cumulative).
  py::tuple cut_step() {
    Batch batch{state_->cut()};
    const int64_t unlinked = batch.unlinked();
    const bool trained = batch.trained();
    py::object out = batch.records.empty() ? py::object(py::none()) : py::cast(std::move(batch));
    return py::make_tuple(out, unlinked, trained, state_->counted(), eager_bypassed());
  }
  void release(Batch& batch) { state_->release(batch.records); }
  // The recorder's optimizer hook for quiet steps (QuietSteps) on this tap's records.
  std::unique_ptr<QuietSteps> quiet_steps(py::object recorder, py::object tap,
                                          py::object fallback) {
    return std::make_unique<QuietSteps>(state_, std::move(recorder), std::move(tap),
                                        std::move(fallback));
  }
  int count(Batch& batch, Tally& tally, const std::vector<int64_t>& keys,
            const std::vector<bool>& recompute, bool give_up_open_backward) {
    return tally.count(*state_, batch, keys, recompute, give_up_open_backward);
  }
  std::pair<int64_t, int> count_run(const std::vector<Batch*>& batches, int64_t shape,
                                    Tally& tally, const std::vector<int64_t>& keys,
                                    const std::vector<bool>& recompute,
                                    const std::vector<bool>& give_up_open_backward) {
    return tally.count_run(*state_, batches, shape, keys, recompute, give_up_open_backward);
  }
  // The first `n` steps left in a run closed by QuietSteps, counted as count_run counts steps
  // (a step closed `grace_s` ago or more no longer waits for a backward that started); the
  // counted ones taken off the run.
  std::pair<int64_t, int> count_quiet(QuietBatches& run, int64_t n, int64_t shape, Tally& tally,
                                      const std::vector<int64_t>& keys,
                                      const std::vector<bool>& recompute, double grace_s) {
    std::vector<Batch*> batches;
    std::vector<bool> give_up;
    const double now = static_cast<double>(steady_ns()) * 1e-9;
    for (size_t i = run.head; i < run.batches.size() && static_cast<int64_t>(batches.size()) < n;
         ++i) {
      batches.push_back(&run.batches[i]);
      give_up.push_back(now - run.closed[i] >= grace_s);
    }
    const auto out = tally.count_run(*state_, batches, shape, keys, recompute, give_up);
    run.head += static_cast<size_t>(out.first);
    return out;
  }
  // Every mark of the steps left in a run given back (they will not be resolved).
  void release(QuietBatches& run) {
    for (size_t i = run.head; i < run.batches.size(); ++i) state_->release(run.batches[i].records);
    run.head = run.batches.size();
  }
  py::dict counts() const { return state_->counts(); }
  int64_t oldest_open_ns() { return state_->oldest_open_ns(); }

  // A call of the Python wrapper: the ops it reaches pass through unless it is linked.
  static void enter() {
    if (t_python++ == 0) {
      t_seen = false;
      t_link = 0;
    }
  }
  static void exit() {
    if (--t_python == 0) t_link = 0;
  }
  // Whether a tapped forward op ran inside the wrapper's current call.
  static bool saw() { return t_seen; }

 private:
  static constexpr c10::DispatchKey kKey = c10::DispatchKey::BackendSelect;
  std::shared_ptr<TapState> state_;
  std::map<std::string, std::unique_ptr<torch::Library>> libraries_;  // one per namespace
};

}  // namespace

namespace {
std::atomic<int64_t> g_links{0};
}

// The wrapper's current call is the tap's to time: a fresh link number, set for the tap's next
// forward on this thread (FastBegin in marks.cpp, and Tap.link from Python).
int64_t tap_link() {
  t_link = g_links.fetch_add(1, std::memory_order_relaxed) + 1;
  return t_link;
}

void tap_enter() { Tap::enter(); }
void tap_exit() { Tap::exit(); }

void bind_tap(py::module_& m) {
  m.attr("tap") = true;
  py::class_<Batch>(m, "TapBatch")
      .def("__len__", [](const Batch& b) { return b.records.size(); })
      .def(
          "rows", [](const Batch& b, bool linked) { return TapState::rows(b.records, linked); },
          py::arg("linked") = false)
      .def("links", [](const Batch& b) { return TapState::links(b.records); })
      .def("unlinked", &Batch::unlinked)
      .def("shape", [](const Batch& b) { return static_cast<int64_t>(shape_of(b)); })
      // Each record's forward start mark, in order (to join records to the calls they became).
      .def("firsts",
           [](const Batch& b) {
             std::vector<int64_t> out;
             for (const Record& r : b.records) out.push_back(r.f0);
             return out;
           })
      .def("link_numbers", [](const Batch& b) {
        std::vector<int64_t> out;
        for (const Record& r : b.records) {
          if (r.link != 0) out.push_back(r.link);
        }
        return out;
      });
  py::class_<QuietBatches>(m, "TapRun")
      .def("__len__", &QuietBatches::size)
      // The steps left: when each closed (time.monotonic), and its records.
      .def("closed",
           [](const QuietBatches& r) {
             return std::vector<double>(r.closed.begin() + static_cast<std::ptrdiff_t>(r.head),
                                        r.closed.end());
           })
      .def("sizes",
           [](const QuietBatches& r) {
             std::vector<int64_t> out;
             for (size_t i = r.head; i < r.batches.size(); ++i) {
               out.push_back(static_cast<int64_t>(r.batches[i].records.size()));
             }
             return out;
           })
      // The first step left, taken off: (its cut, closed, wall).
      .def("split", [](QuietBatches& r) {
        if (r.size() == 0) throw py::index_error("no step left in the run");
        const size_t at = r.head++;
        return py::make_tuple(py::cast(std::move(r.batches[at])), r.closed[at], r.wall[at]);
      });
  py::class_<Tally>(m, "Tally")
      .def(py::init<std::vector<double>, double>(), py::arg("bounds"), py::arg("host_share"))
      .def("take", &Tally::take);
  py::class_<QuietSteps>(m, "QuietSteps")
      .def("step", &QuietSteps::step)
      .def("arm", &QuietSteps::arm)
      .def("disarm", &QuietSteps::disarm)
      .def("armed", &QuietSteps::armed)
      .def("take", &QuietSteps::take)
      .def("closed", &QuietSteps::closed)
      .def("errors", &QuietSteps::errors);
  py::class_<Tap>(m, "Tap")
      .def(py::init<std::shared_ptr<Pool>, std::shared_ptr<Pool>, int64_t>(), py::arg("cpu"),
           py::arg("cuda"), py::arg("max_records"))
      .def("install", &Tap::install)
      .def("uninstall", &Tap::uninstall)
      .def("installed", &Tap::installed)
      .def("set_measuring", &Tap::set_measuring)
      .def("cut_step", &Tap::cut_step)
      .def("quiet_steps", &Tap::quiet_steps)
      .def("release", py::overload_cast<Batch&>(&Tap::release))
      .def("release", py::overload_cast<QuietBatches&>(&Tap::release))
      .def("count", &Tap::count)
      .def("count_run", &Tap::count_run)
      .def("count_quiet", &Tap::count_quiet)
      .def("counts", &Tap::counts)
      .def("oldest_open_ns", &Tap::oldest_open_ns)
      .def_static("enter", &Tap::enter)
      .def_static("exit", &Tap::exit)
      .def_static("link", [] { return tap_link(); })
      .def_static("saw", &Tap::saw);
}

#else

int64_t tap_link() { return 0; }  // never called: no signature is linked without the tap
void tap_enter() {}
void tap_exit() {}

void bind_tap(pybind11::module_& m) { m.attr("tap") = false; }

#endif

}  // namespace fadiag
