// exp_poly: included inside the namespace of each file that uses it (cpu_ops.cpp's anonymous one, each
// decode attention family's), so that every copy is compiled for that file's target and none is shared
// between them at link time. No include here: <algorithm>, <cmath>, <cstdint> and <cstring> come first.
// expf after Cephes (about 1 ulp on [-87, 88]), branch- and call-free so that the loops of
// softmax and SiLU vectorize: a libm call per element would cost more than the rest of them.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}
