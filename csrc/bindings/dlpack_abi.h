// The DLPack C ABI (data-apis.org DLPack, versions 0.8 and 1.x): the structs a producer hands to a
// consumer inside a PyCapsule. Only the parts the core exports (1-D host byte buffers) are named.
#pragma once

#include <cstdint>

namespace hetpipe::dlpack {

enum DeviceType : std::int32_t { kDLCPU = 1 };
enum DataTypeCode : std::uint8_t { kDLUInt = 1 };

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};

// Capsule name "dltensor" (consumed: "used_dltensor").
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

// Capsule name "dltensor_versioned" (consumed: "used_dltensor_versioned"), DLPack >= 1.0.
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;
  DLTensor dl_tensor;
};

}  // namespace hetpipe::dlpack
