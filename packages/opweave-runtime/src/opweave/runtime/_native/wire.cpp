// The native point-to-point wire of CPU ranks: byte messages over one TCP connection per pair of
// ranks, as torch operators (namespace ``opweave``) that a compiled rank program calls from its
// C++ wrapper, with no Python between a token's actions.
//
// A message is a 16-byte header (payload length, tag) and the payload. A send never blocks: it
// writes what the socket takes at once and hands the rest, copied, to the wire's writer thread,
// so no rank can stall another however large its messages are. A receive reads on the calling
// thread straight into the tensor it returns, busy-polling up to the wire's spin budget before it
// blocks, and fails after the wire's timeout. Errors are ``RuntimeError``s whose text starts with
// ``opweave-peer <rank>:`` naming the peer, so the caller can report who failed.
//
// The comm operators take an ``after`` tensor they do not read: threading each operator's output
// into the next one's ``after`` orders them in a traced graph as the schedule orders them.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/uio.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Peer {
  int64_t rank = -1;
  int fd = -1;
  std::mutex mu;                          // guards out / offset
  std::deque<std::vector<uint8_t>> out;   // bytes the socket has not taken yet
  size_t offset = 0;                      // of out.front() already written
};

struct Wire {
  std::map<int64_t, std::unique_ptr<Peer>> peers;
  double timeout_s = 600.0;
  double spin_s = 0.0;
  double wait_s = 0.0;  // time receives spent waiting (the calling thread's only)
  bool dry = false;     // sends do nothing and receives return zeros (a program's warm-up)
  std::atomic<int64_t> bytes_sent{0};
  std::atomic<int64_t> messages_sent{0};
  std::mutex mu;  // guards pending, stop, error; with cv wakes the writer
  std::condition_variable cv;
  bool pending = false;
  bool stop = false;
  std::string error;  // the writer's failure, raised by the next operator
  std::thread writer;

  ~Wire() {  // a wire still open when the process exits
    if (!writer.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_one();
    writer.join();
  }
};

std::mutex registry_mu;
std::map<int64_t, std::unique_ptr<Wire>> registry;

// The last error an operator raised in this process. A compiled graph's C++ wrapper calls the
// operators through torch's stable dispatcher shim, which replaces an exception's text with its
// own; the caller reads the original here (``wire_last_error``).
std::mutex last_error_mu;
std::string last_error;

[[noreturn]] void fail(const std::string& text) {
  {
    std::lock_guard<std::mutex> lock(last_error_mu);
    last_error = text;
  }
  throw std::runtime_error(text);
}

[[noreturn]] void peer_error(int64_t peer, const std::string& text) {
  fail("opweave-peer " + std::to_string(peer) + ": " + text);
}

Wire& wire_of(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(id);
  if (it == registry.end()) {
    fail("opweave: no native wire " + std::to_string(id) + " is open");
  }
  return *it->second;
}

Peer& peer_of(Wire& w, int64_t peer) {
  auto it = w.peers.find(peer);
  if (it == w.peers.end()) {
    fail("opweave: the native wire has no connection to rank " +
                             std::to_string(peer));
  }
  return *it->second;
}

void raise_writer_error(Wire& w) {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    error = w.error;
  }
  if (!error.empty()) fail(error);
}

// Write as much of p.out as the socket takes now; false on a failed peer (error set).
bool write_some(Wire& w, Peer& p) {
  while (!p.out.empty()) {
    auto& head = p.out.front();
    ssize_t n = ::send(p.fd, head.data() + p.offset, head.size() - p.offset,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return true;
      if (err == EINTR) continue;
      std::lock_guard<std::mutex> lock(w.mu);
      if (w.error.empty()) {
        w.error = "opweave-peer " + std::to_string(p.rank) + ": sending to rank " +
                  std::to_string(p.rank) + " failed: " + std::strerror(err);
      }
      p.out.clear();
      return false;
    }
    p.offset += static_cast<size_t>(n);
    if (p.offset == head.size()) {
      p.out.pop_front();
      p.offset = 0;
    }
  }
  return true;
}

void writer_loop(Wire* w) {
  std::vector<pollfd> fds;
  std::vector<Peer*> who;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(w->mu);
      w->cv.wait(lock, [w] { return w->pending || w->stop; });
      if (w->stop) return;
    }
    fds.clear();
    who.clear();
    bool any = false;
    for (auto& [rank, p] : w->peers) {
      std::lock_guard<std::mutex> lock(p->mu);
      if (!p->out.empty()) {
        fds.push_back({p->fd, POLLOUT, 0});
        who.push_back(p.get());
        any = true;
      }
    }
    if (!any) {
      std::lock_guard<std::mutex> lock(w->mu);
      // a send may have queued bytes after the scan: look again before sleeping
      bool queued = false;
      for (auto& [rank, p] : w->peers) {
        std::lock_guard<std::mutex> plock(p->mu);
        queued = queued || !p->out.empty();
      }
      w->pending = queued;
      continue;
    }
    ::poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      std::lock_guard<std::mutex> lock(who[i]->mu);
      write_some(*w, *who[i]);
    }
  }
}

// Queue a message (``header``, then ``data``) for ``p`` and write what fits now.
void post(Wire& w, Peer& p, const void* header, size_t header_len, const void* data, size_t len) {
  bool queued;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    const auto* h = static_cast<const uint8_t*>(header);
    const auto* d = static_cast<const uint8_t*>(data);
    size_t done = 0, total = header_len + len;
    while (p.out.empty() && done < total) {  // try the socket first: a decode step's rows fit
      iovec parts[2];
      int count = 0;
      if (done < header_len) {
        parts[count++] = {const_cast<uint8_t*>(h + done), header_len - done};
      }
      size_t from = done > header_len ? done - header_len : 0;
      if (from < len) parts[count++] = {const_cast<uint8_t*>(d + from), len - from};
      msghdr msg{};
      msg.msg_iov = parts;
      msg.msg_iovlen = count;
      ssize_t n = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        int err = errno;
        if (err == EINTR) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) break;
        peer_error(p.rank, "sending to rank " + std::to_string(p.rank) +
                               " failed: " + std::strerror(err));
      }
      done += static_cast<size_t>(n);
    }
    if (done < total) {  // the rest is copied: the caller's buffer may be reused at once
      std::vector<uint8_t> rest(total - done);
      size_t in_header = done < header_len ? header_len - done : 0;
      if (in_header) std::memcpy(rest.data(), h + done, in_header);
      size_t from = done > header_len ? done - header_len : 0;
      if (len > from) std::memcpy(rest.data() + in_header, d + from, len - from);
      if (p.out.empty()) p.offset = 0;
      p.out.push_back(std::move(rest));
    }
  queued = !p.out.empty();
  }
  if (queued) {
    std::lock_guard<std::mutex> lock(w.mu);
    w.pending = true;
    w.cv.notify_one();
  }
}

// Read exactly ``len`` bytes from ``p`` into ``into``; bounded by the wire's timeout.
void read_exact(Wire& w, Peer& p, uint8_t* into, size_t len, int64_t tag) {
  auto start = Clock::now();
  auto spin_until = start + std::chrono::duration<double>(w.spin_s);
  auto deadline = start + std::chrono::duration<double>(w.timeout_s);
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::recv(p.fd, into + done, len - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      peer_error(p.rank, "lost rank " + std::to_string(p.rank) + " while receiving message " +
                             std::to_string(tag) + ": it closed its connection");
    }
    int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) {
      peer_error(p.rank, "lost rank " + std::to_string(p.rank) + " while receiving message " +
                             std::to_string(tag) + ": " + std::strerror(err));
    }
    auto now = Clock::now();
    if (now >= deadline) {
      std::ostringstream text;
      text << "timed out after " << w.timeout_s << " s receiving message " << tag << " (rank "
           << p.rank << ")";
      peer_error(p.rank, text.str());
    }
    if (now < spin_until) continue;  // busy-poll: a rank with its own core never sleeps
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    pollfd fd{p.fd, POLLIN, 0};
    ::poll(&fd, 1, static_cast<int>(std::min<int64_t>(std::max<int64_t>(left, 1), 1000)));
  }
}

// -- operators ----------------------------------------------------------------------------------

void wire_open(int64_t id, double timeout_s, double spin_s) {
  std::lock_guard<std::mutex> lock(registry_mu);
  if (registry.count(id)) {
    fail("opweave: native wire " + std::to_string(id) + " is already open");
  }
  auto w = std::make_unique<Wire>();
  w->timeout_s = timeout_s;
  w->spin_s = spin_s;
  Wire* raw = w.get();
  registry[id] = std::move(w);
  raw->writer = std::thread(writer_loop, raw);
}

void wire_add(int64_t id, int64_t peer, int64_t fd) {
  Wire& w = wire_of(id);
  int flags = ::fcntl(static_cast<int>(fd), F_GETFL, 0);
  ::fcntl(static_cast<int>(fd), F_SETFL, flags | O_NONBLOCK);
  auto p = std::make_unique<Peer>();
  p->rank = peer;
  p->fd = static_cast<int>(fd);
  w.peers[peer] = std::move(p);
}

// Wait until every queued byte is written; bounded by the timeout.
void wire_drain(int64_t id) {
  Wire& w = wire_of(id);
  auto deadline = Clock::now() + std::chrono::duration<double>(w.timeout_s);
  while (true) {
    raise_writer_error(w);
    int64_t waiting_on = -1;
    for (auto& [rank, p] : w.peers) {
      std::lock_guard<std::mutex> lock(p->mu);
      if (!p->out.empty()) waiting_on = rank;
    }
    if (waiting_on < 0) return;
    if (Clock::now() >= deadline) {
      std::ostringstream text;
      text << "timed out after " << w.timeout_s << " s sending queued messages to rank "
           << waiting_on;
      peer_error(waiting_on, text.str());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void wire_close(int64_t id) {
  std::unique_ptr<Wire> w;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry.find(id);
    if (it == registry.end()) return;
    w = std::move(it->second);
    registry.erase(it);
  }
  std::vector<int> fds;
  for (auto& [rank, p] : w->peers) fds.push_back(p->fd);
  w.reset();  // stops and joins the writer
  for (int fd : fds) ::close(fd);
}

// The text of the last error an operator raised (empty: none), and forget it.
std::string wire_last_error() {
  std::lock_guard<std::mutex> lock(last_error_mu);
  std::string text;
  text.swap(last_error);
  return text;
}

// While ``dry``, sends do nothing and receives return zeros: a rank compiles and runs its
// program once on padding without its peers.
void wire_dry(int64_t id, bool dry) { wire_of(id).dry = dry; }

// float64[3]: seconds receives waited, bytes sent (payload), messages sent
at::Tensor wire_stats(int64_t id) {
  Wire& w = wire_of(id);
  auto out = at::empty({3}, at::TensorOptions().dtype(at::kDouble));
  double* v = out.data_ptr<double>();
  v[0] = w.wait_s;
  v[1] = static_cast<double>(w.bytes_sent.load());
  v[2] = static_cast<double>(w.messages_sent.load());
  return out;
}

// Send ``data``'s bytes to ``peer`` under ``tag`` unless ``when`` (a one-element CPU integer
// tensor) is 0; returns a token that orders the next operator after this one.
at::Tensor op_send(const at::Tensor& data, const at::Tensor& after, const at::Tensor& when,
                int64_t id, int64_t peer, int64_t tag) {
  (void)after;
  Wire& w = wire_of(id);
  raise_writer_error(w);
  auto token = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  token.data_ptr<int64_t>()[0] = 0;
  if (w.dry || when.item<int64_t>() == 0) return token;
  TORCH_CHECK(data.device().is_cpu(), "opweave::send moves CPU tensors");
  at::Tensor bytes = data.is_contiguous() ? data : data.contiguous();
  size_t len = static_cast<size_t>(bytes.numel()) * bytes.element_size();
  int64_t header[2] = {static_cast<int64_t>(len), tag};
  post(w, peer_of(w, peer), header, sizeof(header), bytes.data_ptr(), len);
  w.bytes_sent += static_cast<int64_t>(len);
  w.messages_sent += 1;
  return token;
}

// The next message from ``peer``: it must carry ``tag`` and ``nbytes`` bytes.
at::Tensor op_recv(const at::Tensor& after, int64_t id, int64_t peer, int64_t tag, int64_t nbytes) {
  (void)after;
  Wire& w = wire_of(id);
  raise_writer_error(w);
  Peer& p = peer_of(w, peer);
  if (w.dry) return at::zeros({nbytes}, at::TensorOptions().dtype(at::kByte));
  auto start = Clock::now();
  int64_t header[2];
  read_exact(w, p, reinterpret_cast<uint8_t*>(header), sizeof(header), tag);
  if (header[1] != tag || header[0] != nbytes) {
    std::ostringstream text;
    text << "rank " << peer << " sent message " << header[1] << " (" << header[0]
         << " bytes) while message " << tag << " (" << nbytes
         << " bytes) was expected: schedules differ";
    peer_error(peer, text.str());
  }
  auto out = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte));
  read_exact(w, p, out.data_ptr<uint8_t>(), static_cast<size_t>(nbytes), tag);
  w.wait_s += std::chrono::duration<double>(Clock::now() - start).count();
  return out;
}

// The next message from ``peer``, whatever its length (at most ``max_bytes``): it must carry
// ``tag``. For messages whose size only the sender knows (a packed batch); never traced.
at::Tensor op_recv_any(int64_t id, int64_t peer, int64_t tag, int64_t max_bytes) {
  Wire& w = wire_of(id);
  raise_writer_error(w);
  Peer& p = peer_of(w, peer);
  auto start = Clock::now();
  int64_t header[2];
  read_exact(w, p, reinterpret_cast<uint8_t*>(header), sizeof(header), tag);
  if (header[1] != tag || header[0] < 0 || header[0] > max_bytes) {
    std::ostringstream text;
    text << "rank " << peer << " sent message " << header[1] << " (" << header[0]
         << " bytes) while message " << tag << " was expected: schedules differ";
    peer_error(peer, text.str());
  }
  auto out = at::empty({header[0]}, at::TensorOptions().dtype(at::kByte));
  read_exact(w, p, out.data_ptr<uint8_t>(), static_cast<size_t>(header[0]), tag);
  w.wait_s += std::chrono::duration<double>(Clock::now() - start).count();
  return out;
}

// ``x``, copied, once ``dep`` exists: orders a graph's host inputs after earlier operators.
at::Tensor op_after(const at::Tensor& x, const at::Tensor& dep) {
  (void)dep;
  return x.clone();
}

}  // namespace

TORCH_LIBRARY(opweave, m) {
  m.def("wire_open(int wire, float timeout_s, float spin_s) -> ()", &wire_open);
  m.def("wire_add(int wire, int peer, int fd) -> ()", &wire_add);
  m.def("wire_drain(int wire) -> ()", &wire_drain);
  m.def("wire_close(int wire) -> ()", &wire_close);
  m.def("wire_dry(int wire, bool dry) -> ()", &wire_dry);
  m.def("wire_last_error() -> str", &wire_last_error);
  m.def("wire_stats(int wire) -> Tensor", &wire_stats);
  m.def("wire_recv_any(int wire, int peer, int tag, int max_bytes) -> Tensor", &op_recv_any);
  m.def("send(Tensor data, Tensor after, Tensor when, int wire, int peer, int tag) -> Tensor");
  m.def("recv(Tensor after, int wire, int peer, int tag, int nbytes) -> Tensor");
  m.def("after(Tensor x, Tensor dep) -> Tensor");
}

TORCH_LIBRARY_IMPL(opweave, CPU, m) {
  m.impl("send", &op_send);
  m.impl("recv", &op_recv);
  m.impl("after", &op_after);
}
