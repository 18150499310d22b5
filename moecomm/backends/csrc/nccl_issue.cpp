// The NCCL backend's grouped send/recv, issued from native code (moecomm/backends/nccl.py).
//
// nccl4py's Python layer costs microseconds per call; even its raw bindings cost about a
// microsecond per send or recv. Here one call issues a whole all-to-all: ncclGroupStart,
// an ncclSend and ncclRecv per peer with rows to move, ncclGroupEnd. The functions are
// resolved from the libnccl the process has already loaded (nccl4py's), so that both use
// one library and one communicator object; no NCCL header is needed (the few types are
// declared below, as in nccl.h).

#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kNcclSuccess = 0;
constexpr int kNcclUint8 = 1;  // ncclUint8 in nccl.h's ncclDataType_t

using GroupFn = int (*)();
using P2PFn = int (*)(const void*, size_t, int, int, void*, void*);
using RecvFn = int (*)(void*, size_t, int, int, void*, void*);
using ErrorStringFn = const char* (*)(int);

class NcclCalls {
 public:
  explicit NcclCalls(const std::string& library) {
    handle_ = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle_ == nullptr) {
      throw std::runtime_error("moecomm nccl_issue: " + library + " is not loaded in this process");
    }
    group_start_ = reinterpret_cast<GroupFn>(symbol("ncclGroupStart"));
    group_end_ = reinterpret_cast<GroupFn>(symbol("ncclGroupEnd"));
    send_ = reinterpret_cast<P2PFn>(symbol("ncclSend"));
    recv_ = reinterpret_cast<RecvFn>(symbol("ncclRecv"));
    error_string_ = reinterpret_cast<ErrorStringFn>(symbol("ncclGetErrorString"));
  }
  ~NcclCalls() {
    if (handle_ != nullptr) dlclose(handle_);  // balances the RTLD_NOLOAD reference
  }
  NcclCalls(const NcclCalls&) = delete;
  NcclCalls& operator=(const NcclCalls&) = delete;

  // Rows of row_bytes: send_counts[p] from row send_displs[p] of send (or back to back when
  // send_displs is empty) to peer p; likewise into recv. Blocks issue nothing for zero rows.
  // `peers` (empty: block p goes to and comes from rank p) names the rank of every block;
  // several blocks may name one rank (they match in order).
  void alltoallv(uint64_t comm, uint64_t stream, uint64_t send, uint64_t recv, const std::vector<int64_t>& send_counts,
                 const std::vector<int64_t>& recv_counts, int64_t row_bytes, const std::vector<int64_t>& send_displs,
                 const std::vector<int64_t>& recv_displs, const std::vector<int>& peers) {
    const size_t world = send_counts.size();
    if (recv_counts.size() != world || (!send_displs.empty() && send_displs.size() != world) ||
        (!recv_displs.empty() && recv_displs.size() != world) || (!peers.empty() && peers.size() != world) ||
        row_bytes < 0) {
      throw std::invalid_argument("moecomm nccl_issue: alltoallv got inconsistent arguments");
    }
    auto* c = reinterpret_cast<void*>(comm);
    auto* s = reinterpret_cast<void*>(stream);
    const char* sp = reinterpret_cast<const char*>(send);
    char* rp = reinterpret_cast<char*>(recv);
    py::gil_scoped_release release;  // ncclGroupEnd may wait for a peer's first connection
    check(group_start_(), "ncclGroupStart");
    int64_t so = 0, ro = 0;
    int failed = kNcclSuccess;
    const char* what = nullptr;
    for (size_t p = 0; p < world && failed == kNcclSuccess; ++p) {
      if (!send_displs.empty()) so = send_displs[p];
      if (!recv_displs.empty()) ro = recv_displs[p];
      const int peer = peers.empty() ? int(p) : peers[p];
      if (send_counts[p] > 0) {
        failed = send_(sp + so * row_bytes, size_t(send_counts[p] * row_bytes), kNcclUint8, peer, c, s);
        what = "ncclSend";
      }
      if (failed == kNcclSuccess && recv_counts[p] > 0) {
        failed = recv_(rp + ro * row_bytes, size_t(recv_counts[p] * row_bytes), kNcclUint8, peer, c, s);
        what = "ncclRecv";
      }
      so += send_counts[p];
      ro += recv_counts[p];
    }
    const int ended = group_end_();  // always: a group left open would swallow later calls
    check(failed, what);
    check(ended, "ncclGroupEnd");
  }

 private:
  void* symbol(const char* name) {
    void* fn = dlsym(handle_, name);
    if (fn == nullptr) throw std::runtime_error(std::string("moecomm nccl_issue: libnccl lacks ") + name);
    return fn;
  }
  void check(int result, const char* what) const {
    if (result != kNcclSuccess) {
      throw std::runtime_error(std::string("moecomm: ") + what + " failed: " + error_string_(result));
    }
  }

  void* handle_ = nullptr;
  GroupFn group_start_ = nullptr;
  GroupFn group_end_ = nullptr;
  P2PFn send_ = nullptr;
  RecvFn recv_ = nullptr;
  ErrorStringFn error_string_ = nullptr;
};

}  // namespace

#include "source_hash.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = MOECOMM_EXT_SOURCE_HASH_STR;
  m.doc() = "moecomm: NCCL grouped send/recv issued from native code";
  py::class_<NcclCalls>(m, "NcclCalls")
      .def(py::init<const std::string&>(), py::arg("library"),
           "resolve the NCCL functions from `library`, a libnccl already loaded in this process")
      .def("alltoallv", &NcclCalls::alltoallv, "issue a grouped all-to-all of rows (see nccl_issue.cpp)",
           py::arg("comm"), py::arg("stream"), py::arg("send"), py::arg("recv"), py::arg("send_counts"),
           py::arg("recv_counts"), py::arg("row_bytes"), py::arg("send_displs"), py::arg("recv_displs"),
           py::arg("peers") = std::vector<int>());
}
