#pragma once
/// Real devices for the scheduler core: the CPU loopback device (CPU tensors play device
/// tensors, "host" copies go to other CPU buffers; its streams run inline, or asynchronously
/// on worker threads: Note [The asynchronous loopback device]) and, in
/// cuda_device.hpp, the CUDA device. Both satisfy ferry::Backend. The compute stream is the
/// stream current now (Note [The compute stream is the current one] in offload/tracker.hpp):
/// the CUDA device's live current stream, the loopback device's set_current_stream().

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/backend.hpp"
#include "ferry/program/recorder.hpp"
#include "ferry/real/loopback_streams.hpp"
#include "ferry/units.hpp"

namespace ferry::real {

/// One storage the scheduler refers to. The core counts its references with hold/drop; the
/// entry keeps the storage alive only while that count is positive, so a stale handle never
/// pins memory.
struct BufferEntry {
  at::Storage storage;
  long holds = 0;
  Place place = Place::Device;
  Bytes bytes;
  std::uint32_t slot = 0;               ///< recorder slot
  std::uint32_t stream = 0;             ///< allocated on (adopted: the stream current then)
  std::vector<std::uint32_t> recorded;  ///< streams named by record_stream
};

/// A buffer handle: cheap to copy, empty by default.
using BufferHandle = std::shared_ptr<BufferEntry>;

/// MemAvailable of /proc/meminfo in bytes: the host memory free for new allocations, pinned
/// ones included; nullopt where the kernel does not say.
[[nodiscard]] std::optional<std::int64_t> host_available_bytes();

/// What the real devices share: reference counting, views and recording.
class DeviceBase {
 public:
  struct Stream {
    std::uint32_t index = 0;
    friend bool operator==(Stream, Stream) = default;
  };

  explicit DeviceBase(std::unique_ptr<Recorder> recorder);
  virtual ~DeviceBase() = default;
  DeviceBase(const DeviceBase&) = delete;
  DeviceBase& operator=(const DeviceBase&) = delete;

  /// The stream current now; the recorder writes compute on it.
  Stream compute_stream() { return Stream{current_index()}; }

  void hold(const BufferHandle& buffer);
  void drop(const BufferHandle& buffer);
  [[nodiscard]] long use_count(const BufferHandle& buffer) const;

  /// A handle for the storage of `tensor` (a saved activation written by compute), with no
  /// scheduler reference yet.
  BufferHandle adopt(const at::Tensor& tensor);
  /// The tensor `like` describes, rebuilt over `buffer` starting `offset` bytes in.
  [[nodiscard]] static at::Tensor view(const BufferHandle& buffer, Bytes offset,
                                       at::IntArrayRef sizes, at::IntArrayRef strides,
                                       at::ScalarType dtype);
  /// Compute reads `bytes` of `buffer` from `offset` (recorded only).
  void consume(const BufferHandle& buffer, Bytes offset, Bytes bytes);

  /// Buffers with scheduler references, by where they live.
  [[nodiscard]] std::int64_t live_device_buffers() const { return live_device_; }
  [[nodiscard]] std::int64_t live_host_buffers() const { return live_host_; }

  [[nodiscard]] Recorder* recorder() const { return recorder_.get(); }

  /// Pinned allocations are refused (allocate returns nullopt) when they would leave less than
  /// `reserve` bytes of the host's available memory (MemAvailable in /proc/meminfo).
  void set_host_reserve(Bytes reserve) { host_reserve_ = reserve; }
  /// Pinned allocations refused so far for lack of host memory.
  [[nodiscard]] std::int64_t host_refusals() const { return host_refusals_; }

 protected:
  BufferHandle make_entry(at::Storage storage, Place place, Bytes bytes, std::int64_t stream);
  /// Whether `bytes` of pinned memory leave the reserve free (counts a refusal when not).
  bool host_room(Bytes bytes);
  /// A new buffer over `storage` holding one reference (what allocate returns).
  BufferHandle allocated(at::Storage storage, Place place, Bytes bytes, std::uint32_t stream);
  static void check_copy(const BufferHandle& src, Bytes src_offset, const BufferHandle& dst,
                         Bytes dst_offset, Bytes bytes);
  std::uint32_t new_stream(std::string_view name);
  static std::uint8_t* bytes_of(const BufferHandle& buffer);
  /// The index of the stream current now (registering it on first sight where the device
  /// learns of streams made elsewhere).
  virtual std::uint32_t current_index() { return current_; }
  /// Compute wrote `buffer` (adopt) / reads it (consume).
  virtual void produced(const BufferHandle& /*buffer*/) {}
  virtual void consumed(const BufferHandle& /*buffer*/) {}
  /// The last reference to `buffer` went: give its storage back.
  virtual void free_storage(BufferEntry& buffer) { buffer.storage = at::Storage(); }

  std::uint32_t current_ = 0;  ///< loopback: set_current_stream()

  std::unique_ptr<Recorder> recorder_;
  Bytes host_reserve_;
  std::int64_t host_refusals_ = 0;

 private:
  std::uint32_t streams_ = 0;
  std::int64_t live_device_ = 0;
  std::int64_t live_host_ = 0;
};

/// CPU tensors as device tensors: the whole autograd integration without a GPU.
class LoopbackDevice : public DeviceBase {
 public:
  struct Event {
    std::uint32_t index = 0;  ///< the recorder's
    /// The point of the last record, shared by the event's copies (a null token inline).
    std::shared_ptr<LoopbackStreams::Token> last;
  };
  using Buffer = BufferHandle;

  /// `streams` says whether copies run at once on the host or on worker threads (Note [The
  /// asynchronous loopback device]); the streams are made here, once.
  explicit LoopbackDevice(std::unique_ptr<Recorder> recorder = nullptr,
                          const LoopbackConfig& streams = {});
  ~LoopbackDevice() override;
  LoopbackDevice(const LoopbackDevice&) = delete;
  LoopbackDevice& operator=(const LoopbackDevice&) = delete;

  Stream make_stream(std::string_view name);
  /// Makes the compute stream named `name` current (made on first use; "compute" is the one
  /// current at the start), as `torch.cuda.set_stream` does on a GPU: the compute that follows,
  /// and the scheduler's packs and unpacks, are on it; the recorded program has the new stream
  /// wait for the one before, as a caller of `torch.cuda.stream` makes it. A test's way to run
  /// work on a second stream (CPU compute itself runs on the host thread whatever the stream).
  void set_current_stream(std::string_view name);
  Event make_event();
  std::optional<Buffer> allocate(Place place, Bytes bytes, Stream stream, std::string_view name);
  void copy(Stream stream, const Buffer& src, Bytes src_offset, const Buffer& dst, Bytes dst_offset,
            Bytes bytes, std::string_view name);
  void record(Event event, Stream stream);
  void wait(Stream stream, Event event);
  void record_stream(const Buffer& buffer, Stream stream);
  void synchronize(Stream stream);
  /// Which tensors this device treats as device tensors.
  [[nodiscard]] static bool is_device_tensor(const at::Tensor& t) { return t.is_cpu(); }
  /// Asynchronous streams: the races observed so far (each poisoned a buffer); 0 otherwise.
  [[nodiscard]] std::int64_t races() const { return streams_impl_->races(); }

 private:
  void produced(const BufferHandle& buffer) override;
  void consumed(const BufferHandle& buffer) override;
  void free_storage(BufferEntry& buffer) override;
  static LoopbackStreams::Block block_of(const BufferHandle& buffer);

  std::unique_ptr<LoopbackStreams> streams_impl_;  ///< inline or asynchronous, never null
  /// The compute streams by name, with their indices (copy streams are not among them).
  std::vector<std::pair<std::string, std::uint32_t>> compute_streams_{{"compute", 0}};
};

static_assert(Backend<LoopbackDevice>);

}  // namespace ferry::real
