// The DLPack C ABI (data-apis.org DLPack, versions 0.8 and 1.x): the structs a producer hands to a
// consumer inside a PyCapsule. Named here: what the core exports (1-D host byte buffers) and what it
// reads when it consumes a foreign array (bindings/foreign.h): device types, dtype codes, flags.
#pragma once

#include <cstdint>

namespace hetpipe::dlpack {

enum DeviceType : std::int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // page-locked host memory (cudaHostAlloc / cudaMallocHost)
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16,
  kDLMAIA = 17,
};

enum DataTypeCode : std::uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
};

// DLManagedTensorVersioned::flags (DLPack >= 1.0; the sub-byte bit since 1.1).
constexpr std::uint64_t kFlagReadOnly = std::uint64_t{1} << 0;
constexpr std::uint64_t kFlagIsCopied = std::uint64_t{1} << 1;
constexpr std::uint64_t kFlagSubbyteTypePadded = std::uint64_t{1} << 2;

// The ABI major version of DLManagedTensorVersioned this code reads; a consumer passes
// max_version=(kMajor, kMinor) to __dlpack__.
constexpr std::uint32_t kMajor = 1;
constexpr std::uint32_t kMinor = 0;

// Capsule names. A consumer that takes the tensor renames the capsule to the "used_" name, so the
// capsule's destructor no longer calls the deleter: the consumer calls it once done.
constexpr const char* kCapsuleLegacy = "dltensor";
constexpr const char* kCapsuleLegacyUsed = "used_dltensor";
constexpr const char* kCapsuleVersioned = "dltensor_versioned";
constexpr const char* kCapsuleVersionedUsed = "used_dltensor_versioned";

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

// shape and strides count elements; strides may be null (compact row-major).
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

// Capsule name "dltensor_versioned" (consumed: "used_dltensor_versioned"), DLPack >= 1.0. The
// fields up to `deleter` keep their place in every version, so a consumer that meets a major
// version it cannot read can still call the deleter.
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;
  DLTensor dl_tensor;
};

}  // namespace hetpipe::dlpack
