// The pool of timing marks shared by the forward marks, the autograd hooks and the dispatcher tap.
//
// A mark is a slot in a pool. On CUDA a slot holds a timing event recorded on the current stream;
// on CPU it holds a steady-clock reading. Slots are handed out and given back under a mutex, so
// any thread may take one (the tap takes them on whatever thread dispatches an op, with or
// without the GIL); a slot's generation guards against a late hook writing into a slot that has
// since been reused. Nothing here synchronises with the device, and nothing here throws into a
// caller that cannot take it: errors are counted and read from Python.

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#ifdef FADIAG_CUDA
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fadiag {

// The host's steady clock in ns: the CPU marks, and the host times of marks (record age, held).
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr int64_t kChunk = 1024;
constexpr int64_t kMaxChunks = 1024;  // a million slots: far beyond any step's calls

struct Slot {
  std::atomic<uint32_t> generation{0};
  std::atomic<bool> recorded{false};
  int64_t host_ns = 0;  // when the mark was taken (on CPU: the mark itself)
  bool start_passed = false;  // an end mark: the device had passed the window's start (mark)
  std::atomic<bool> in_capture{false};  // its last mark was refused: a CUDA graph captured the stream
#ifdef FADIAG_CUDA
  cudaEvent_t event = nullptr;
  int device = -1;
#endif
};

class Pool {
 public:
  explicit Pool(bool cuda) : cuda_(cuda) {
#ifndef FADIAG_CUDA
    TORCH_CHECK(!cuda, "fadiag native marks were built without CUDA");
#endif
    for (auto& c : chunks_) c.store(nullptr);
  }

  ~Pool() {
    for (auto& c : chunks_) {
      Slot* chunk = c.load();
      if (chunk == nullptr) continue;
#ifdef FADIAG_CUDA
      for (int64_t i = 0; i < kChunk; ++i) {
        if (chunk[i].event != nullptr) cudaEventDestroy(chunk[i].event);
      }
#endif
      delete[] chunk;
    }
  }

  // Make slots [0, n) exist. Called from Python (under the GIL) before handing a slot out.
  void ensure(int64_t n) {
    TORCH_CHECK(n >= 1 && n <= kChunk * kMaxChunks, "fadiag marks out of range: ", n);
    const int64_t last = (n - 1) / kChunk;
    if (chunks_[last].load(std::memory_order_acquire) != nullptr) return;
    for (int64_t c = 0; c <= last; ++c) {
      if (chunks_[c].load(std::memory_order_acquire) == nullptr) {
        chunks_[c].store(new Slot[kChunk], std::memory_order_release);
      }
    }
  }

  // Take a mark now. Never throws (hooks call it): failures go to the error counter.
  // A window's end mark names its start (`since`, -1 for a start mark) and, on CUDA, first asks
  // whether the device has passed that start. If it has, the device reached the window while
  // the host was still queueing the op's work, so it may have run dry inside the window and
  // waited for the host's launches — whether it was idle at the start mark, ran out of work
  // between the marks, or finished the op before the end mark (held_host_ns). If it has not,
  // every kernel of the window was queued before the device got there: device time only (but
  // for the ~1 µs between this query and the end event's record).
  // On a stream that a CUDA graph is capturing no mark is taken (false; counted in captured()):
  // a timing event or a query there would invalidate the user's capture. The tap, which checks
  // before it times an op, passes `capture_checked`.
  bool mark(int64_t slot, uint32_t generation, bool check_generation,
            bool capture_checked = false, int64_t since = -1) noexcept {
    Slot* s = at(slot);
    if (s == nullptr) {
      errors_.fetch_add(1);
      return false;
    }
    if (check_generation && s->generation.load(std::memory_order_acquire) != generation) {
      return false;  // the slot was released and reused: this hook's call is long gone
    }
    s->start_passed = false;
    s->in_capture.store(false, std::memory_order_relaxed);
    if (cuda_) {
#ifdef FADIAG_CUDA
      int device = 0;
      if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        errors_.fetch_add(1);
        return false;
      }
      cudaStream_t stream =
          c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
      if (!capture_checked && stream_capturing(stream)) {
        captured_.fetch_add(1);
        s->in_capture.store(true, std::memory_order_release);
        return false;
      }
      if (!ensure_event(s, device)) {
        cudaGetLastError();
        errors_.fetch_add(1);
        return false;
      }
      s->start_passed = passed(since);
      if (cudaEventRecord(s->event, stream) != cudaSuccess) {
        cudaGetLastError();
        errors_.fetch_add(1);
        return false;
      }
#endif
    }
    s->host_ns = steady_ns();
    s->recorded.store(true, std::memory_order_release);
    return true;
  }

  // Whether a CUDA graph is capturing the current stream of the current device (false for the
  // CPU pool, and where the query fails).
  bool capturing() const {
    if (!cuda_) return false;
#ifdef FADIAG_CUDA
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return stream_capturing(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
#else
    return false;
#endif
  }

  // A free slot (existing or new). Slots are handed out and given back from Python threads; the
  // mutex keeps the free list sound whoever holds the GIL.
  int64_t take() {
    std::lock_guard<std::mutex> lock(slots_mu_);
    if (!free_.empty()) {
      const int64_t s = free_.back();
      free_.pop_back();
      return s;
    }
    ensure(next_ + 1);
    return next_++;
  }

  // A free slot, marked now (`capture_checked`, `since`: see mark).
  int64_t take_marked(bool capture_checked = false, int64_t since = -1) {
    const int64_t s = take();
    mark(s, 0, false, capture_checked, since);
    return s;
  }

  void give_back(int64_t slot) {
    if (at(slot) == nullptr) return;
    release(slot);
    std::lock_guard<std::mutex> lock(slots_mu_);
    free_.push_back(slot);
  }

  // Several slots given back (-1: none) with one lock of the free list: a step's marks, from the
  // resolver, while the training and autograd threads take slots for the next step's.
  void give_back_all(const std::vector<int64_t>& slots) {
    for (int64_t slot : slots) release(slot);  // which passes over -1 as give_back does
    std::lock_guard<std::mutex> lock(slots_mu_);
    for (int64_t slot : slots) {
      if (at(slot) != nullptr) free_.push_back(slot);
    }
  }

  int64_t slots() {
    std::lock_guard<std::mutex> lock(slots_mu_);
    return next_;
  }

  // Slots handed out by take() and not given back yet.
  int64_t in_use() {
    std::lock_guard<std::mutex> lock(slots_mu_);
    return next_ - static_cast<int64_t>(free_.size());
  }

  bool recorded(int64_t slot) const {
    const Slot* s = at(slot);
    return s != nullptr && s->recorded.load(std::memory_order_acquire);
  }

  // Whether the slot's last mark was refused because a CUDA graph was capturing the stream (a
  // backward hook that fired during a capture: the work it would time runs at each replay).
  bool in_capture(int64_t slot) const {
    const Slot* s = at(slot);
    return s != nullptr && s->in_capture.load(std::memory_order_acquire);
  }

  // True once the device has passed the mark (an event query; no synchronisation).
  bool done(int64_t slot) {
    Slot* s = at(slot);
    if (s == nullptr || !s->recorded.load(std::memory_order_acquire)) return false;
    if (!cuda_) return true;
#ifdef FADIAG_CUDA
    cudaError_t r = cudaEventQuery(s->event);
    if (r == cudaSuccess) return true;
    cudaGetLastError();
    TORCH_CHECK(r == cudaErrorNotReady, "cudaEventQuery: ", cudaGetErrorString(r));
#endif
    return false;
  }

  // Seconds between two done marks; call only after done() was true for both.
  double elapsed(int64_t a, int64_t b) {
    const std::optional<double> s = elapsed_if_done(a, b);
    TORCH_CHECK(s.has_value(), "cudaEventElapsedTime: the device has not passed both marks");
    return *s;
  }

  // Seconds between two recorded marks, or nullopt while the device has not passed both: one
  // CUDA call, as cudaEventElapsedTime answers cudaErrorNotReady then (no query made first).
  std::optional<double> elapsed_if_done(int64_t a, int64_t b) {
    Slot* sa = at(a);
    Slot* sb = at(b);
    TORCH_CHECK(sa != nullptr && sb != nullptr, "unknown fadiag mark");
    if (!cuda_) return static_cast<double>(sb->host_ns - sa->host_ns) * 1e-9;
#ifdef FADIAG_CUDA
    float ms = 0.0f;
    const cudaError_t r = cudaEventElapsedTime(&ms, sa->event, sb->event);
    if (r == cudaSuccess) return static_cast<double>(ms) * 1e-3;
    cudaGetLastError();
    TORCH_CHECK(r == cudaErrorNotReady, "cudaEventElapsedTime: ", cudaGetErrorString(r));
    return std::nullopt;
#else
    return 0.0;
#endif
  }

  // The host ns the window between two recorded marks may hold: the host's time between them
  // when the device had passed the start before the end mark was taken (see mark), else 0
  // (at least 1 when it had).
  int64_t held_host_ns(int64_t a, int64_t b) const {
    const Slot* sa = at(a);
    const Slot* sb = at(b);
    if (sa == nullptr || sb == nullptr || !sb->start_passed) return 0;
    return std::max<int64_t>(sb->host_ns - sa->host_ns, 1);
  }

  // One call's two windows (forward: f0..f1, backward: b0..b1; -1: no mark) into `o`: forward
  // and backward seconds, then the host ns each may hold (held_host_ns). False while a mark the
  // device has not passed is needed; a backward that started and has not ended is waited for
  // unless `give_up_open_backward`. The backward reads 0 when it did not run (or was not hooked)
  // and -1 when it ran while a CUDA graph captured the stream (its marks refused: the kernels run
  // at the graph's replays, unseen); both read NaN where the forward marks failed. One CUDA call
  // a window: its elapsed time, which says whether the device has passed both ends.
  bool read_call(int64_t f0, int64_t f1, int64_t b0, int64_t b1, bool give_up_open_backward,
                 double o[4]) {
    o[0] = o[1] = o[2] = o[3] = 0.0;
    if (!recorded(f0) || !recorded(f1)) {
      o[0] = o[1] = std::numeric_limits<double>::quiet_NaN();
      return true;
    }
    const std::optional<double> forward = elapsed_if_done(f0, f1);
    if (!forward) return false;
    o[0] = *forward;
    o[2] = static_cast<double>(held_host_ns(f0, f1));
    if (in_capture(b0) || in_capture(b1)) {
      o[1] = -1.0;
      return true;
    }
    if (b0 < 0 || !recorded(b0)) return true;
    if (b1 < 0 || !recorded(b1)) return give_up_open_backward;
    const std::optional<double> backward = elapsed_if_done(b0, b1);
    if (!backward) return false;
    o[1] = *backward;
    o[3] = static_cast<double>(held_host_ns(b0, b1));
    return true;
  }

  // The slot may be handed out again; hooks still holding it are disarmed.
  void release(int64_t slot) {
    Slot* s = at(slot);
    if (s == nullptr) return;
    s->recorded.store(false, std::memory_order_release);
    s->in_capture.store(false, std::memory_order_relaxed);
    s->generation.fetch_add(1, std::memory_order_acq_rel);
  }

  uint32_t generation(int64_t slot) const {
    const Slot* s = at(slot);
    return s == nullptr ? 0 : s->generation.load(std::memory_order_acquire);
  }

  bool cuda() const { return cuda_; }
  int64_t events_created() const { return created_.load(); }
  int64_t errors() const { return errors_.load(); }
  int64_t captured() const { return captured_.load(); }
  int64_t backward_starts() const { return backward_starts_.load(); }
  int64_t in_backward() const { return in_backward_.load(); }
  void backward_started() {
    in_backward_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      backward_starts_.fetch_add(1);
      if (armed_.load() > 0) window_.store(true);
    }
    cv_.notify_all();
  }

  // A backward the dispatcher tap timed (no hook, no window): counted with the hooked ones, so
  // that the recorder sees a backward ran before its next forward.
  void backward_seen() { backward_starts_.fetch_add(1); }

  void backward_ended() {
    int64_t v = in_backward_.load();
    while (v > 0 && !in_backward_.compare_exchange_weak(v, v - 1)) {
    }
  }

  // The backward window: open from a hooked backward's start until every hooked call's backward
  // has ended (or its graph was freed without one). While it is open the training thread is
  // blocked in backward() with the GIL released, so work done then takes nothing from the step.
  void armed() { armed_.fetch_add(1); }
  void disarmed() {
    if (armed_.fetch_sub(1) <= 1) window_.store(false);
  }
  bool window() const { return window_.load(); }
  // The dispatcher tap's side of the window: open while its forwards still wait for backward ops
  // inside a backward pass, shut when none does. Each backward op opens it: only the first of a
  // pass takes the lock and wakes a waiter (the others find it open).
  void tap_window(bool open) {
    if (!open) {
      if (armed_.load() <= 0) window_.store(false);
      return;
    }
    if (window_.load()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      window_.store(true);
    }
    cv_.notify_all();
  }

  // Block (the caller has released the GIL) until the window is open, wake_window() is called,
  // or `timeout_s` passes; true on either of the first two.
  bool wait_window(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool ready = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                    [&] { return window_.load() || woken_; });
    woken_ = false;
    return ready;
  }
  // Ends the current (or the next) wait_window at once: someone waits for the resolver (flush),
  // which must not sit out its wait for a window first.
  void wake_window() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      woken_ = true;
    }
    cv_.notify_all();
  }

  // A step boundary: whatever backward ran is over.
  void reset_in_backward() {
    in_backward_.store(0);
    window_.store(false);
  }

 private:
  Slot* at(int64_t slot) const {
    if (slot < 0 || slot >= kChunk * kMaxChunks) return nullptr;
    Slot* chunk = chunks_[slot / kChunk].load(std::memory_order_acquire);
    return chunk == nullptr ? nullptr : &chunk[slot % kChunk];
  }

#ifdef FADIAG_CUDA
  static bool stream_capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return status != cudaStreamCaptureStatusNone;
  }

  // Whether the device has passed the recorded mark `since` (an event query: no synchronisation);
  // false for -1 or a mark not recorded.
  bool passed(int64_t since) const noexcept {
    const Slot* a = at(since);
    if (a == nullptr || a->event == nullptr || !a->recorded.load(std::memory_order_acquire)) {
      return false;
    }
    if (cudaEventQuery(a->event) == cudaSuccess) return true;
    cudaGetLastError();
    return false;
  }

  bool ensure_event(Slot* s, int device) {
    if (s->event != nullptr && s->device == device) return true;
    if (s->event != nullptr) cudaEventDestroy(s->event);
    s->event = nullptr;
    if (cudaEventCreateWithFlags(&s->event, cudaEventDefault) != cudaSuccess) return false;
    s->device = device;
    created_.fetch_add(1);
    return true;
  }
#endif

  bool cuda_;
  std::atomic<Slot*> chunks_[kMaxChunks];
  std::atomic<int64_t> created_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<int64_t> captured_{0};
  std::atomic<int64_t> backward_starts_{0};
  std::atomic<int64_t> in_backward_{0};
  std::atomic<int64_t> armed_{0};
  std::atomic<bool> window_{false};
  bool woken_ = false;  // under mu_: wake_window() was called since the last wait_window()
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex slots_mu_;
  std::vector<int64_t> free_;
  int64_t next_ = 0;
};


}  // namespace fadiag
