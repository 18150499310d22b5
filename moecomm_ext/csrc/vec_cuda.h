// Vectorised row access for the elementwise CUDA kernels (glu_cuda.cu, seg_cuda.cu): packs of
// VEC elements moved as one load or store of up to 16 bytes, the widest VEC a row length and its
// pointers allow, and a grid for grid-stride loops. Device code: include from .cu files only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace moecomm_ext {
namespace vec {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const Pack<T, VEC>& v) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = v;
}

inline bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// the widest VEC (16 bytes at most) that a row of `len` elements and every pointer allow
template <typename T>
int pick_vec(int64_t len, std::initializer_list<const void*> ptrs) {
  for (int v = static_cast<int>(16 / sizeof(T)); v > 1; v /= 2) {
    bool ok = len % v == 0;
    for (const void* p : ptrs) ok = ok && (p == nullptr || aligned(p, v * sizeof(T)));
    if (ok) return v;
  }
  return 1;
}

// f(std::integral_constant<int, v>{}) for v (8, 4, 2 or 1): a kernel launched with its vector width
// as a template argument from a width picked at run time
template <typename F>
void with_vec(int v, F&& f) {
  switch (v) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

// enough blocks to fill any current GPU several times over; the grid-stride loop takes the rest
inline dim3 grid_for(int64_t items, int threads) {
  constexpr int64_t kMaxBlocks = 4096;
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + threads - 1) / threads, kMaxBlocks))));
}

}  // namespace vec
}  // namespace moecomm_ext
