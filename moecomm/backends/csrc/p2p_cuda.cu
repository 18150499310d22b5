// Peer-memory all-to-all of moecomm's NVLink transport (moecomm/backends/p2p.py).
//
// Every rank owns one arena (cudaMalloc, shared with the other ranks of the node through
// CUDA IPC). It serves two protocols, each with its own headers and data regions, so that
// they never touch each other's memory. Arena layout, for W ranks:
//   [0, 2 * W * 64)                          counts-on-the-GPU headers: parity x source
//   [2 * W * 64, 4 * W * 64)                 copy-engine headers: half x source
//   [4 * W * 64, 5 * W * 64)                 copy-engine acks: source
//   each header is 64 bytes: int64 count, then int64 sequence number (counts on the GPU: then
//   the sender's dtype code, row-shape code, row bytes and flags: whether any of its blocks
//   overflows the inline capacity, whether its counts were bad; copy engines: then the
//   exchange's meta words, see MetaWords); an ack one int64
//   [data_off, data_off + 2 * W * region)    counts-on-the-GPU data regions: parity x source
//   [.. + 2 * W * region, .. + 4 * W * region)  copy-engine data regions: half x source
//
// Counts on the GPU (send_wait_kernel): exchange number `seq` (counted by the host) uses
// parity seq % 2. The sender writes its rows for rank p into rank p's region (parity,
// sender), then the header (count, then seq, each behind a system-scope fence). The
// receiver waits until every header of its parity carries `seq` (one block of the same
// kernel) and writes the counts into mapped host memory. Why parity suffices: a sender
// reaches exchange s only after it saw every peer's header of s - 1, and a peer writes that
// header only after its own stream passed the copy-out of exchange s - 2, which read the
// region that s now overwrites. Only the counts live on the GPU; the host never learns them
// before the rows move.
//
// Known counts (ce_exchange) move the rows with copy engines (cudaMemcpyAsync), not SMs: a
// ready kernel (see ce_ready_kernel), the copies into the peers' regions, one small kernel
// that writes the headers (the stream starts it only once the copies have completed) and
// waits for the peers' headers, and the copies out of this rank's regions; the rank's own
// rows go straight from input to output (beside the rest, on a second stream, when they
// are large). Their sequence numbers live on the device (see signal_wait_kernel), so that
// these exchanges can be captured into a CUDA graph and replayed.

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("moecomm p2p: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// Makes `device` current for the guard's lifetime (kernels must launch on their stream's device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int device_ = 0;
};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until done() holds (a peer's write has landed); false once timeout_ns have passed.
template <typename Done>
__device__ __forceinline__ bool spin_until(Done done, uint64_t timeout_ns) {
  const uint64_t start = global_ns();
  while (!done()) {
    if (global_ns() - start > timeout_ns) return false;
    __nanosleep(64);
  }
  return true;
}

// dst[i] = src[i] for i = first, first + stride, ... < n, four vectors in flight per thread.
__device__ __forceinline__ void copy_vectors(uint4* dst, const uint4* src, int64_t n, int64_t first, int64_t stride) {
  int64_t i = first;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// A block of `count` rows travels inline (in the kernel's round) when it fits `cap` rows
// whole; a larger one goes whole in the exchange that follows (moecomm/backends/p2p.py).
__device__ __forceinline__ int64_t inline_rows(int64_t count, int64_t cap) {
  return count >= 0 && count <= cap ? count : 0;
}

// What the sender tells every receiver beside its count (header words 2-5): its dtype and
// row-shape codes and row bytes (a receiver names any disagreement), and flags: whether any
// of its blocks overflows the inline capacity (then every rank joins the exchange that
// follows), whether its counts are bad (then no rank returns rows: every rank raises).
constexpr int64_t kOverflows = 1;
constexpr int64_t kBadCounts = 2;
struct SenderInfo {
  int64_t dtype_code, shape_code, row_bytes;
};

// Block b (< W * blocks_per_peer) of the send role: group p = b / blocks_per_peer copies
// this rank's rows for rank p into p's region, and the group's last block writes the header.
// Counts that are negative or do not add up to the `x_rows` rows of x move no row and set
// the header's kBadCounts flag (every rank raises), so that bad counts on the device never
// read past x.
__device__ void send_rows(int block, const uint4* __restrict__ x, int64_t x_rows, const int64_t* __restrict__ counts,
                          SenderInfo info, const uint64_t* __restrict__ peer_bases, int me, int world, int64_t seq,
                          int parity, int64_t region_bytes, int64_t data_off, int64_t hdr_off, unsigned int* done,
                          int blocks_per_peer) {
  const int64_t row_bytes = info.row_bytes;
  const int p = block / blocks_per_peer;
  const int b = block % blocks_per_peer;
  int64_t offset = 0, total = 0;
  bool bad = false;
  for (int q = 0; q < world; ++q) {
    if (q < p) offset += counts[q];
    total += counts[q];
    bad = bad || counts[q] < 0;
  }
  const int64_t count = counts[p];
  const int64_t cap = region_bytes / row_bytes;
  int64_t rows = inline_rows(count, cap);
  if (bad || total != x_rows) rows = 0;
  const int64_t vectors = rows * row_bytes / 16;
  char* base = reinterpret_cast<char*>(peer_bases[p]);
  uint4* dst = reinterpret_cast<uint4*>(base + data_off + (int64_t(parity) * world + me) * region_bytes);
  const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(x) + offset * row_bytes);
  copy_vectors(dst, src, vectors, int64_t(b) * blockDim.x + threadIdx.x, int64_t(blocks_per_peer) * blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's rows are visible before it counts itself done
    const unsigned int before = atomicAdd(&done[p], 1u);
    if (before == unsigned(blocks_per_peer - 1)) {  // the last block of the group signals
      done[p] = 0;
      __threadfence_system();
      volatile int64_t* hdr =
          reinterpret_cast<volatile int64_t*>(base + hdr_off + (int64_t(parity) * world + me) * 64);
      int64_t flags = (bad || total != x_rows) ? kBadCounts : 0;
      for (int q = 0; q < world; ++q) flags |= counts[q] > cap ? kOverflows : 0;
      hdr[0] = count;
      hdr[2] = info.dtype_code;
      hdr[3] = info.shape_code;
      hdr[4] = row_bytes;
      hdr[5] = flags;
      __threadfence_system();
      hdr[1] = seq;
    }
  }
}

// The wait role (one block): thread p waits for rank p's header of exchange `seq`.
// out (device) and host (mapped host memory) get [0:W] = counts received, [W:2W] = this
// rank's own counts, [2W] = 1 on timeout; host[2W + 2 + 4p : 2W + 6 + 4p] = rank p's header
// words 2-5; then host[2W + 1] = seq tells the host it is all there.
__device__ void wait_headers(const char* my_base, int64_t hdr_off, int parity, int world, int64_t seq,
                             const int64_t* __restrict__ counts, int64_t* out, volatile int64_t* host,
                             uint64_t timeout_ns) {
  __shared__ int timed_out;
  const int p = threadIdx.x;
  if (p == 0) timed_out = 0;
  __syncthreads();
  if (p < world) {
    volatile const int64_t* hdr =
        reinterpret_cast<volatile const int64_t*>(my_base + hdr_off + (int64_t(parity) * world + p) * 64);
    const bool arrived = spin_until([&] { return hdr[1] == seq; }, timeout_ns);
    if (!arrived) timed_out = 1;
    if (arrived) {
      __threadfence_system();
      const int64_t got = hdr[0];
      out[p] = got;
      host[p] = got;
      for (int j = 0; j < 4; ++j) host[2 * world + 2 + 4 * p + j] = hdr[2 + j];
    }
    out[world + p] = counts[p];
    host[world + p] = counts[p];
  }
  __syncthreads();
  if (p == 0) {
    out[2 * world] = timed_out;
    host[2 * world] = timed_out;
    __threadfence_system();
    host[2 * world + 1] = seq;
  }
}

// Grid: W * blocks_per_peer + 1 blocks: the send role, then one block waiting. The waiting
// block only waits on the peers' progress, never on this grid's other blocks.
__global__ void send_wait_kernel(const uint4* __restrict__ x, int64_t x_rows, const int64_t* __restrict__ counts,
                                 SenderInfo info,
                                 const uint64_t* __restrict__ peer_bases, const char* my_base, int me, int world,
                                 int64_t seq, int parity, int64_t region_bytes, int64_t data_off, int64_t hdr_off,
                                 unsigned int* done, int blocks_per_peer, int64_t* out, volatile int64_t* host,
                                 uint64_t timeout_ns) {
  if (blockIdx.x < world * blocks_per_peer) {
    send_rows(blockIdx.x, x, x_rows, counts, info, peer_bases, me, world, seq, parity, region_bytes, data_off, hdr_off,
              done, blocks_per_peer);
  } else {
    wait_headers(my_base, hdr_off, parity, world, seq, counts, out, host, timeout_ns);
  }
}

// Grid: W * blocks_per_source blocks; group p copies the rows rank p left in this rank's
// region (parity, p), its block where it traveled inline, to their place in `out` (sources in rank
// order). `received` holds the counts (the wait kernel's output).
__global__ void copy_out_kernel(const char* my_base, int64_t data_off, int parity, int world, int64_t region_bytes,
                                int64_t row_bytes, const int64_t* __restrict__ received, uint4* out,
                                int blocks_per_source) {
  const int p = blockIdx.x / blocks_per_source;
  const int b = blockIdx.x % blocks_per_source;
  int64_t offset = 0;
  for (int q = 0; q < p; ++q) offset += received[q];
  const int64_t cap = region_bytes / row_bytes;
  const int64_t count = received[p];
  const int64_t rows = inline_rows(count, cap);
  const int64_t vectors = rows * row_bytes / 16;
  const uint4* src = reinterpret_cast<const uint4*>(my_base + data_off + (int64_t(parity) * world + p) * region_bytes);
  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<char*>(out) + offset * row_bytes);
  copy_vectors(dst, src, vectors, int64_t(b) * blockDim.x + threadIdx.x, int64_t(blocks_per_source) * blockDim.x);
}

// Up to kMaxSegments (source, destination, bytes) copies of one known-counts round done by SMs
// (ce_exchange with `kernels`): group i of `blocks_per_segment` thread blocks copies segment i.
// Every address and size is a multiple of 16 bytes (the host checks it).
constexpr int kMaxSegments = 32;  // ranks whose known-counts rounds SM kernels may move
struct Segments {
  const char* src[kMaxSegments];
  char* dst[kMaxSegments];
  int64_t bytes[kMaxSegments];
};

__global__ void copy_segments_kernel(Segments seg, int blocks_per_segment) {
  const int i = blockIdx.x / blocks_per_segment;
  const int b = blockIdx.x % blocks_per_segment;
  copy_vectors(reinterpret_cast<uint4*>(seg.dst[i]), reinterpret_cast<const uint4*>(seg.src[i]), seg.bytes[i] / 16,
               int64_t(b) * blockDim.x + threadIdx.x, int64_t(blocks_per_segment) * blockDim.x);
}

// One kernel for the non-empty ones of these copies (at most kMaxSegments).
void launch_segments(const std::vector<const char*>& src, const std::vector<char*>& dst,
                     const std::vector<int64_t>& bytes, cudaStream_t stream) {
  if (src.size() > size_t(kMaxSegments)) throw std::invalid_argument("moecomm p2p: more copies than kMaxSegments");
  Segments seg{};
  int n = 0;
  int64_t most = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    if (bytes[i] <= 0) continue;
    seg.src[n] = src[i];
    seg.dst[n] = dst[i];
    seg.bytes[n] = bytes[i];
    most = std::max(most, bytes[i]);
    ++n;
  }
  if (n == 0) return;
  // one block of 512 threads per 128 KiB of the largest segment, 1 to 32 per segment
  const int per = static_cast<int>(std::min<int64_t>(32, std::max<int64_t>(1, most >> 17)));
  copy_segments_kernel<<<n * per, 512, 0, stream>>>(seg, per);
  check(cudaGetLastError(), "copy kernel launch");
}

constexpr int kMaxCopyEngineRanks = 128;
constexpr int64_t kOwnCopyInLineBytes = 4 << 20;

struct RankCounts {
  int64_t v[kMaxCopyEngineRanks];
};

// What a known-counts exchange is, in header words 2-6 (kind, dtype, row shape and wire dtype
// codes, rows per block): compared by the receiver where the host did not agree on it first
// (the peer backend's equal blocks); zeros elsewhere (equal on every rank).
constexpr int kMetaWords = 5;
struct MetaWords {
  int64_t v[kMetaWords];
};

// The known-counts exchanges (copy engines) keep their state on the device, so that a CUDA
// graph that captured them replays correctly: `state` (this GPU's memory, int64) holds
// [0] c, the number of such exchanges completed here, [1 + q] the number of the last one
// that used buffer half q. The half of each exchange is chosen by the host when it is
// issued (and so fixed in a captured graph); halves normally alternate, but a replayed
// graph may repeat one. So before writing into a peer's half q, a rank waits (ready
// kernel) until that peer has copied out the last exchange that used q: each rank's ready
// kernel first publishes `ack` = c into every peer's arena (its own copy-outs of exchanges
// 1..c precede it on its stream), then waits for every peer's ack to reach state[1 + q].
// With alternating halves that holds at once (the peer reached this exchange's ready
// kernel before it wrote the header this rank already waited for), so the host leaves the
// ready kernel out where it knows the exchange before this one on the device used the other
// half: every exchange of a capture but its first, and eager exchanges while this transport
// has never been captured (no replay can have run in between). Then the argument of the
// counts-on-the-GPU protocol above holds unchanged.

// One block; thread p publishes this rank's ack into rank p's arena, then waits for rank
// p's ack in this one's to reach state[need_slot]: 1 + q, the last exchange that used half q
// (see above), or 0, every exchange before this one (direct exchanges: the peer's stream has
// reached this exchange, so nothing it issued earlier still uses the output the rows are
// written into). A timeout is reported as code 1 in status[3p] (host memory).
__global__ void ce_ready_kernel(const uint64_t* __restrict__ peer_bases, const char* my_base, int me, int world,
                                int need_slot, int64_t ack_off, const int64_t* __restrict__ state,
                                volatile int64_t* status, uint64_t timeout_ns) {
  const int p = threadIdx.x;
  if (p >= world || p == me) return;
  const int64_t done_here = state[0];
  const int64_t need = state[need_slot];
  volatile int64_t* out = reinterpret_cast<volatile int64_t*>(reinterpret_cast<char*>(peer_bases[p]) + ack_off +
                                                               int64_t(me) * 64);
  __threadfence_system();
  *out = done_here;
  volatile const int64_t* ack = reinterpret_cast<volatile const int64_t*>(my_base + ack_off + int64_t(p) * 64);
  if (!spin_until([&] { return *ack >= need; }, timeout_ns)) {
    status[3 * p + 2] = need;
    status[3 * p] = 1;
  }
  __threadfence_system();  // the peer's copy-out reads happened before this rank's writes that follow
}

// One block; thread p writes this rank's header of exchange seq = state[0] + 1 (count, the
// meta words, then seq) into rank p's arena, then waits for rank p's header in this rank's
// arena and checks its count against `expected` and its meta words against this rank's. On a
// problem it writes status[3p .. 3p + 2] (host memory, mapped; plain stores, never cleared):
// code (1 = timed out, 2 = the counts disagree: the count rank p sent, the count expected;
// 3 = a meta word differs: its index, rank p's value). A source whose status already holds a
// problem is not waited for again (a rank that went on to a round its peer never runs, after
// they disagreed, must not spin until the timeout). Then the state advances to seq.
__global__ void signal_wait_kernel(const uint64_t* __restrict__ peer_bases, const char* my_base, int me, int world,
                                   int parity, int64_t hdr_off, int64_t* state, RankCounts sent, RankCounts expected,
                                   MetaWords meta, volatile int64_t* status, uint64_t timeout_ns) {
  const int p = threadIdx.x;
  const int64_t seq = state[0] + 1;
  __syncthreads();  // every thread has read the state before thread 0 advances it below
  if (p < world) {
    volatile int64_t* out = reinterpret_cast<volatile int64_t*>(reinterpret_cast<char*>(peer_bases[p]) + hdr_off +
                                                                 (int64_t(parity) * world + me) * 64);
    __threadfence_system();  // the copies before this kernel on its stream have completed
    out[0] = sent.v[p];
    for (int i = 0; i < kMetaWords; ++i) out[2 + i] = meta.v[i];
    __threadfence_system();
    out[1] = seq;
    volatile const int64_t* hdr =
        reinterpret_cast<volatile const int64_t*>(my_base + hdr_off + (int64_t(parity) * world + p) * 64);
    const bool known_bad = status[3 * p] != 0;
    const bool arrived = !known_bad && spin_until([&] { return hdr[1] == seq; }, timeout_ns);
    if (!arrived && !known_bad) {
      status[3 * p + 2] = expected.v[p];
      status[3 * p] = 1;
      __threadfence_system();
    }
    if (arrived) {
      __threadfence_system();
      const int64_t got = hdr[0];
      int differs = -1;
      for (int i = kMetaWords - 1; i >= 0; --i) {
        if (hdr[2 + i] != meta.v[i]) differs = i;
      }
      if (differs >= 0) {
        status[3 * p + 1] = differs;
        status[3 * p + 2] = hdr[2 + differs];
        status[3 * p] = 3;
        __threadfence_system();
      } else if (got != expected.v[p]) {
        status[3 * p + 1] = got;
        status[3 * p + 2] = expected.v[p];
        status[3 * p] = 2;
        __threadfence_system();
      }
    }
  }
  __syncthreads();
  if (p == 0) {
    state[0] = seq;
    state[1 + parity] = seq;
  }
}

// Used rows only, GPU-initiated (moecomm.LowLatencyBuffer on the peer backend, concurrent
// ranks): block p of the input (`in_block` bytes from p * in_block) holds counts[p] * scale
// rows of `row_bytes` for rank p; they go straight to `dst[p]` (this rank's block in rank p's
// output, mapped through IPC; its own output for itself). One sequence number per exchange,
// kept on the device (`state`), so that a captured exchange replays. Two kernels, so that only
// single blocks ever spin (ranks sharing a GPU run many grids at once: spinning grids could
// hold the SMs their peers need):
// - rows_ready_kernel (one block): every rank writes `seq` into each peer's ready slot
//   (ready_dst[p]: "my stream has passed everything before this exchange: my output is free")
//   and waits for every peer's;
// - rows_send_wait_kernel: groups of blocks copy the rows for each peer, a group's last block
//   writes (rows, then seq) into the peer's flag slot (flag_dst[p]); one more block waits for
//   every peer's flag and writes the rows it got into recv_rows (when given). The last block
//   to finish stores seq.
// A wait past timeout_ns sets status[0] = 1 (mapped host memory) and gives up.
__global__ void rows_ready_kernel(const uint64_t* __restrict__ ready_dst, const int64_t* my_ready,
                                  const int64_t* state, int world, volatile int64_t* status, uint64_t timeout_ns) {
  const int q = threadIdx.x;
  if (q >= world) return;
  const int64_t seq = *reinterpret_cast<volatile const int64_t*>(state) + 1;
  __threadfence_system();  // (what this stream did before is done before the peers may write)
  *reinterpret_cast<volatile int64_t*>(ready_dst[q]) = seq;
  volatile const int64_t* ready = reinterpret_cast<volatile const int64_t*>(my_ready + q);
  if (!spin_until([&] { return *ready >= seq; }, timeout_ns)) {
    status[0] = 1;
  }
  __threadfence_system();  // the peer's earlier writes are seen before this exchange writes into its output
}

// The used rows of one block gathered from `src` by `index` (row i of the block is src row
// index[i]; an index outside [0, src_rows) copies nothing): a warp per row (its index read
// once), the row's 16-byte vectors copied four in flight per lane, as copy_vectors does;
// block b of `blocks` takes warps' rows b * warps + w, then every blocks * warps-th.
__device__ __forceinline__ void gather_rows_to(char* to, const char* __restrict__ src, const int64_t* __restrict__ index,
                                               int64_t src_rows, int64_t rows, int64_t row_bytes, int b, int blocks) {
  const int64_t per_row = row_bytes / 16;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  for (int64_t r = int64_t(b) * warps + threadIdx.x / 32; r < rows; r += int64_t(blocks) * warps) {
    const int64_t from = index[r];
    if (from < 0 || from >= src_rows) continue;
    copy_vectors(reinterpret_cast<uint4*>(to + r * row_bytes), reinterpret_cast<const uint4*>(src + from * row_bytes),
                 per_row, lane, 32);
  }
}

__global__ void rows_send_wait_kernel(const char* __restrict__ src, int64_t in_block, int64_t row_bytes,
                                      const int64_t* __restrict__ src_index, int64_t src_rows,
                                      const int64_t* __restrict__ counts, int64_t scale,
                                      const uint64_t* __restrict__ dst, const uint64_t* __restrict__ flag_dst,
                                      const int64_t* my_flags, int64_t* state, unsigned int* done, int world,
                                      int blocks_per_peer, int64_t* recv_rows, volatile int64_t* status,
                                      uint64_t timeout_ns) {
  __shared__ int64_t seq;
  __shared__ int failed;  // status read once per block (mapped host memory): one answer for the block
  if (threadIdx.x == 0) {
    seq = *reinterpret_cast<volatile int64_t*>(state) + 1;
    failed = status[0] != 0;
  }
  __syncthreads();
  if (blockIdx.x == world * blocks_per_peer) {  // the wait block
    const int q = threadIdx.x;
    if (q < world) {
      volatile const int64_t* flag = reinterpret_cast<volatile const int64_t*>(my_flags + 2 * q);
      if (spin_until([&] { return flag[1] == seq; }, timeout_ns)) {
        __threadfence_system();
        const int64_t got = flag[0];
        if (got < 0) status[0] = 1;  // the peer gave up on this exchange: its rows never came
        if (recv_rows != nullptr) recv_rows[q] = got < 0 ? 0 : got;
      } else {
        status[0] = 1;
        if (recv_rows != nullptr) recv_rows[q] = 0;
      }
      __threadfence_system();
    }
  } else {
    const int p = blockIdx.x / blocks_per_peer, b = blockIdx.x % blocks_per_peer;
    const int64_t asked = counts[p] * scale, fit = in_block / row_bytes;  // never past a block, whatever counts say
    const int64_t rows = asked < 0 ? 0 : (asked < fit ? asked : fit);
    if (rows > 0 && !failed) {
      const int64_t bytes = rows * row_bytes;
      const char* from = src + int64_t(p) * in_block;
      char* to = reinterpret_cast<char*>(dst[p]);
      const int64_t first = int64_t(b) * blockDim.x + threadIdx.x, stride = int64_t(blocks_per_peer) * blockDim.x;
      if (src_index != nullptr) {  // (row_bytes and the addresses 16-byte aligned: checked by the launcher)
        gather_rows_to(to, src, src_index + int64_t(p) * fit, src_rows, rows, row_bytes, b, blocks_per_peer);
      } else if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(from) % 16 == 0 && reinterpret_cast<uintptr_t>(to) % 16 == 0) {
        copy_vectors(reinterpret_cast<uint4*>(to), reinterpret_cast<const uint4*>(from), bytes / 16, first, stride);
      } else {
        for (int64_t i = first; i < bytes; i += stride) to[i] = from[i];
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();  // this block's rows are visible before it counts itself done
      if (atomicAdd(&done[p], 1u) == unsigned(blocks_per_peer - 1)) {
        done[p] = 0;
        volatile int64_t* flag = reinterpret_cast<volatile int64_t*>(flag_dst[p]);
        flag[0] = failed ? -1 : rows;  // -1: this rank timed out and sent nothing; the peer raises too
        __threadfence_system();
        flag[1] = seq;
      }
    }
  }
  if (threadIdx.x == 0) {  // the last block to finish moves the sequence on (every block has read it)
    __threadfence();
    if (atomicAdd(&done[world], 1u) == gridDim.x - 1) {
      done[world] = 0;
      *state = seq;
    }
  }
}

// Both kernels on `stream`. `done`: world + 1 zeroed unsigned ints of this exchange's own.
// `src_index` (0: none): block p's row i is row src_index[p * in_block / row_bytes + i] of `src`
// (`src_rows` rows), gathered on the way; else block p is `in_block` bytes from src + p * in_block.
void rows_exchange(int device, uint64_t stream_handle, uint64_t src, int64_t in_block, int64_t row_bytes,
                   uint64_t src_index, int64_t src_rows,
                   uint64_t counts, int64_t scale, uint64_t dst, uint64_t flag_dst, uint64_t ready_dst,
                   uint64_t my_flags, uint64_t my_ready, uint64_t state, uint64_t done, int world, int blocks_per_peer,
                   uint64_t recv_rows, uint64_t status, uint64_t timeout_ns) {
  if (world < 1 || world > 512 || row_bytes <= 0 || blocks_per_peer < 1 || in_block < 0 || scale < 1) {
    throw std::invalid_argument("rows_exchange: world must be in [1, 512], row_bytes and scale positive, "
                                "blocks_per_peer at least 1 and in_block not negative; got world " +
                                std::to_string(world) + ", row_bytes " + std::to_string(row_bytes) +
                                ", blocks_per_peer " + std::to_string(blocks_per_peer) + ", in_block " +
                                std::to_string(in_block) + ", scale " + std::to_string(scale));
  }
  if (src_index != 0 && (row_bytes % 16 != 0 || src % 16 != 0 || src_rows < 0)) {
    throw std::invalid_argument("rows_exchange: gathering rows needs row_bytes and the source address 16-byte "
                                "aligned and src_rows not negative; got row_bytes " + std::to_string(row_bytes) +
                                ", src_rows " + std::to_string(src_rows));
  }
  DeviceGuard guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int threads = 32 * ((world + 31) / 32);
  rows_ready_kernel<<<1, threads, 0, stream>>>(reinterpret_cast<const uint64_t*>(ready_dst),
                                               reinterpret_cast<const int64_t*>(my_ready),
                                               reinterpret_cast<const int64_t*>(state), world,
                                               reinterpret_cast<volatile int64_t*>(status), timeout_ns);
  check(cudaGetLastError(), "rows-ready kernel launch");
  rows_send_wait_kernel<<<world * blocks_per_peer + 1, 512, 0, stream>>>(
      reinterpret_cast<const char*>(src), in_block, row_bytes, reinterpret_cast<const int64_t*>(src_index),
      src_rows, reinterpret_cast<const int64_t*>(counts), scale,
      reinterpret_cast<const uint64_t*>(dst), reinterpret_cast<const uint64_t*>(flag_dst),
      reinterpret_cast<const int64_t*>(my_flags), reinterpret_cast<int64_t*>(state),
      reinterpret_cast<unsigned int*>(done), world, blocks_per_peer, reinterpret_cast<int64_t*>(recv_rows),
      reinterpret_cast<volatile int64_t*>(status), timeout_ns);
  check(cudaGetLastError(), "rows-exchange kernel launch");
}

uint64_t alloc(int device, int64_t nbytes) {
  DeviceGuard guard(device);
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, size_t(nbytes)), "cudaMalloc");
  check(cudaMemset(ptr, 0, size_t(nbytes)), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return reinterpret_cast<uint64_t>(ptr);
}

void release(uint64_t ptr) { check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree"); }

py::bytes ipc_handle(uint64_t ptr) {
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
  return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uint64_t ipc_open(int device, const std::string& bytes) {
  DeviceGuard guard(device);
  if (bytes.size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("moecomm p2p: bad IPC handle size");
  cudaIpcMemHandle_t handle;
  memcpy(&handle, bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uint64_t>(ptr);
}

void ipc_close(uint64_t ptr) { check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle"); }

void launch_copy_out(int device, uint64_t my_base, int64_t data_off, int parity, int world, int64_t region_bytes,
                     int64_t row_bytes, uint64_t received, uint64_t out, int blocks_per_source, uint64_t stream) {
  DeviceGuard guard(device);
  copy_out_kernel<<<world * blocks_per_source, 512, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const char*>(my_base), data_off, parity, world, region_bytes, row_bytes,
      reinterpret_cast<const int64_t*>(received), reinterpret_cast<uint4*>(out), blocks_per_source);
  check(cudaGetLastError(), "copy-out kernel launch");
}

uint64_t new_event(int device) {
  DeviceGuard guard(device);
  cudaEvent_t event;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return reinterpret_cast<uint64_t>(event);
}

void destroy_event(uint64_t event) { cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)); }

RankCounts pack_counts(const std::vector<int64_t>& values) {
  RankCounts out{};
  for (size_t i = 0; i < values.size(); ++i) out.v[i] = values[i];
  return out;
}

MetaWords pack_meta(const std::vector<int64_t>& values) {
  MetaWords out{};
  for (size_t i = 0; i < values.size() && i < size_t(kMetaWords); ++i) out.v[i] = values[i];
  return out;
}

// Exclusive prefix sums: blocks back to back.
std::vector<int64_t> back_to_back(const std::vector<int64_t>& counts) {
  std::vector<int64_t> out(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) out[i] = out[i - 1] + counts[i - 1];
  return out;
}

bool aligned16(uint64_t x, uint64_t out, int64_t row_bytes, int64_t region_bytes, int64_t data_off,
               const std::vector<uint64_t>& peer_dst) {
  bool ok = (x | out) % 16 == 0 && row_bytes % 16 == 0 && region_bytes % 16 == 0 && data_off % 16 == 0;
  for (uint64_t d : peer_dst) ok = ok && d % 16 == 0;
  return ok;
}

// The known-counts exchange (see the top of this file). Counts and displacements are in
// rows (displacements empty: blocks back to back); the headers carry the whole counts (the
// receiver checks them), but rows beyond a region's capacity per pair are left to the
// caller. Enqueued on `stream`, the rank's own block on `aux_stream` (joined back into
// `stream`). `ready_slot`: the ready kernel's state slot (-1: none). Direct exchanges:
// `peer_dst[p]` (not 0) is where this rank's rows go in rank p's output (its allocation
// mapped through IPC): the block goes there whole, no region between; `copy_out` false where
// this rank's own output was written that way (nothing to copy out of its regions). They
// need ready_slot 0: a peer's output may be memory that work it issued before the exchange
// still uses, until its stream reaches the exchange. `meta` (at most kMetaWords, the rest
// zero) travels in the headers and every receiver compares it with its own.
void ce_exchange(int device, uint64_t stream_handle, uint64_t aux_handle, uint64_t fork_event, uint64_t join_event,
                 uint64_t x, uint64_t out, int64_t row_bytes, const std::vector<int64_t>& send_counts,
                 const std::vector<int64_t>& send_displs, const std::vector<int64_t>& recv_counts,
                 const std::vector<int64_t>& recv_displs, const std::vector<uint64_t>& bases, uint64_t bases_device,
                 int me, uint64_t state, int parity, int ready_slot, int64_t region_bytes, int64_t data_off,
                 int64_t hdr_off, int64_t ack_off, uint64_t status, uint64_t timeout_ns,
                 const std::vector<uint64_t>& peer_dst, bool copy_out, const std::vector<int64_t>& meta,
                 bool kernels) {
  const int world = static_cast<int>(bases.size());
  if (world > kMaxCopyEngineRanks || send_counts.size() != size_t(world) || recv_counts.size() != size_t(world) ||
      (!send_displs.empty() && send_displs.size() != size_t(world)) ||
      (!recv_displs.empty() && recv_displs.size() != size_t(world)) || row_bytes <= 0 ||
      (!peer_dst.empty() && peer_dst.size() != size_t(world)) || ready_slot > 2 || meta.size() > size_t(kMetaWords)) {
    throw std::invalid_argument("moecomm p2p: ce_exchange got inconsistent arguments");
  }
  const std::vector<int64_t> send_at = send_displs.empty() ? back_to_back(send_counts) : send_displs;
  const std::vector<int64_t> recv_at = recv_displs.empty() ? back_to_back(recv_counts) : recv_displs;
  DeviceGuard guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto aux = reinterpret_cast<cudaStream_t>(aux_handle);
  const int64_t cap = region_bytes / row_bytes;
  const char* src = reinterpret_cast<const char*>(x);
  char* dst = reinterpret_cast<char*>(out);
  const int64_t own = send_counts[me] * row_bytes;
  // SM kernels (one launch for the sends, own block included, one for the copies out) or a copy-engine copy per
  // block; the caller chooses, and SM kernels need every segment 16-byte aligned
  const bool by_kernels = kernels && world <= kMaxSegments && aligned16(x, out, row_bytes, region_bytes, data_off,
                                                                        peer_dst);
  const auto region_of = [&](int owner, int sender) {
    return reinterpret_cast<char*>(bases[owner]) + data_off + (int64_t(parity) * world + sender) * region_bytes;
  };
  // a small own block is copied in line (four fewer runtime calls); a large one beside the peers' copies
  const bool beside = !by_kernels && own > kOwnCopyInLineBytes;
  if (!by_kernels && own > 0) {
    if (beside) {
      check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(fork_event), stream), "cudaEventRecord");
      check(cudaStreamWaitEvent(aux, reinterpret_cast<cudaEvent_t>(fork_event), 0), "cudaStreamWaitEvent");
    }
    check(cudaMemcpyAsync(dst + recv_at[me] * row_bytes, src + send_at[me] * row_bytes, size_t(own),
                          cudaMemcpyDeviceToDevice, beside ? aux : stream),
          "cudaMemcpyAsync (own rows)");
    if (beside) check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(join_event), aux), "cudaEventRecord");
  }
  const int threads = 32 * ((world + 31) / 32);
  if (ready_slot >= 0) {  // the caller knows whether the exchange before this one (on the device) used the other half
    ce_ready_kernel<<<1, threads, 0, stream>>>(reinterpret_cast<const uint64_t*>(bases_device),
                                              reinterpret_cast<const char*>(bases[me]), me, world, ready_slot, ack_off,
                                              reinterpret_cast<const int64_t*>(state),
                                              reinterpret_cast<volatile int64_t*>(status), timeout_ns);
    check(cudaGetLastError(), "ready kernel launch");
  }
  std::vector<const char*> from;
  std::vector<char*> to;
  std::vector<int64_t> bytes;
  for (int p = 0; p < world; ++p) {
    const bool direct = !peer_dst.empty() && peer_dst[p] != 0;  // straight into rank p's output, whole
    const int64_t rows = direct ? send_counts[p] : std::min(send_counts[p], cap);
    if (p == me) {
      if (by_kernels) {
        from.push_back(src + send_at[me] * row_bytes);
        to.push_back(dst + recv_at[me] * row_bytes);
        bytes.push_back(own);
      }
    } else if (rows > 0) {
      from.push_back(src + send_at[p] * row_bytes);
      to.push_back(direct ? reinterpret_cast<char*>(peer_dst[p]) : region_of(p, me));
      bytes.push_back(rows * row_bytes);
    }
  }
  const auto move = [&](const char* what) {
    if (by_kernels) {
      launch_segments(from, to, bytes, stream);
    } else {
      for (size_t i = 0; i < from.size(); ++i) {
        check(cudaMemcpyAsync(to[i], from[i], size_t(bytes[i]), cudaMemcpyDeviceToDevice, stream), what);
      }
    }
    from.clear();
    to.clear();
    bytes.clear();
  };
  move("cudaMemcpyAsync (to a peer)");
  signal_wait_kernel<<<1, threads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(bases_device), reinterpret_cast<const char*>(bases[me]), me, world, parity,
      hdr_off, reinterpret_cast<int64_t*>(state), pack_counts(send_counts), pack_counts(recv_counts), pack_meta(meta),
      reinterpret_cast<volatile int64_t*>(status), timeout_ns);
  check(cudaGetLastError(), "signal/wait kernel launch");
  for (int p = 0; p < world && copy_out; ++p) {
    const int64_t rows = std::min(recv_counts[p], cap);
    if (p == me || rows <= 0) continue;
    from.push_back(region_of(me, p));
    to.push_back(dst + recv_at[p] * row_bytes);
    bytes.push_back(rows * row_bytes);
  }
  move("cudaMemcpyAsync (out of the arena)");
  if (beside) check(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(join_event), 0), "cudaStreamWaitEvent");
}

// The counts-on-the-GPU exchange, issued in one call on the caller's `stream`: ordered
// after the backend's stream (its last operation may still read an arena region this one
// overwrites), then one kernel that sends and waits, and writes the counts to `host`
// (mapped host memory) with host[2W + 1] = seq last.
void gpu_counts_exchange(int device, uint64_t stream_handle, uint64_t backend_stream, uint64_t order_event,
                         uint64_t x, int64_t x_rows, uint64_t counts, int64_t row_bytes, int64_t dtype_code, int64_t shape_code,
                         uint64_t peer_bases, uint64_t my_base, int me,
                         int world, int64_t seq, int parity, int64_t region_bytes, int64_t data_off, int64_t hdr_off,
                         uint64_t done, int blocks_per_peer, uint64_t result, uint64_t host, uint64_t timeout_ns) {
  DeviceGuard guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(order_event), reinterpret_cast<cudaStream_t>(backend_stream)),
        "cudaEventRecord");
  check(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(order_event), 0), "cudaStreamWaitEvent");
  send_wait_kernel<<<world * blocks_per_peer + 1, 512, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), x_rows, reinterpret_cast<const int64_t*>(counts),
      SenderInfo{dtype_code, shape_code, row_bytes}, reinterpret_cast<const uint64_t*>(peer_bases), reinterpret_cast<const char*>(my_base), me, world, seq, parity,
      region_bytes, data_off, hdr_off, reinterpret_cast<unsigned int*>(done), blocks_per_peer,
      reinterpret_cast<int64_t*>(result), reinterpret_cast<volatile int64_t*>(host), timeout_ns);
  check(cudaGetLastError(), "send/wait kernel launch");
}

// The id of the capture sequence `stream` is part of (unique over the process), 0 if none.
uint64_t capture_id(uint64_t stream_handle) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  check(cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream_handle), &status, &id),
        "cudaStreamGetCaptureInfo");
  return status == cudaStreamCaptureStatusActive ? uint64_t(id) : 0;
}

bool can_access_peer(int device, int peer) {
  int ok = 0;
  check(cudaDeviceCanAccessPeer(&ok, device, peer), "cudaDeviceCanAccessPeer");
  return ok != 0;
}

}  // namespace

#include "source_hash.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = MOECOMM_EXT_SOURCE_HASH_STR;
  m.doc() = "moecomm peer-memory all-to-all kernels and CUDA IPC helpers (raw pointers as ints)";
  m.def("alloc", &alloc, "cudaMalloc nbytes, zeroed; returns the pointer");
  m.def("free", &release, "cudaFree");
  m.def("ipc_handle", &ipc_handle, "CUDA IPC handle (bytes) of an allocation");
  m.def("ipc_open", &ipc_open, "map a peer's allocation from its IPC handle; returns the pointer");
  m.def("ipc_close", &ipc_close, "unmap a peer's allocation");
  m.def("launch_copy_out", &launch_copy_out, "enqueue the copy of the received rows into the output");
  m.def("new_event", &new_event, "an event without timing; returns its handle");
  m.def("destroy_event", &destroy_event, "cudaEventDestroy");
  m.def("gpu_counts_exchange", &gpu_counts_exchange, "enqueue the counts-on-the-GPU exchange (one kernel)");
  m.def("ce_exchange", &ce_exchange, "enqueue a known-counts exchange moved by copy engines");
  m.def("rows_exchange", &rows_exchange, "enqueue a used-rows exchange into mapped peer outputs (one kernel)");
  m.def("max_copy_engine_ranks", []() { return kMaxCopyEngineRanks; });
  m.def("can_access_peer", &can_access_peer, "cudaDeviceCanAccessPeer");
  m.def("capture_id", &capture_id, "id of the CUDA graph capture a stream takes part in (0: none)");
}
