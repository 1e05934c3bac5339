// Quantize-on-write: one thread per group of GROUP values of a new K/V row.
// rows (num_tokens * kv_heads, D) -> codes (.., D * BITS / 32) uint32, scales, biases (.., D / GROUP).
// Same steps as kv_quant.quantize_rows: scale and bias are rounded to the pool dtype P
// first, and the codes are computed from the rounded values.
const int g = int(thread_position_in_grid.x);
constexpr int GROUPS = D / GROUP;
constexpr int PER_WORD = 32 / BITS;
constexpr float LEVELS = float((1 << BITS) - 1);
const int row = g / GROUPS;
const int first = row * D + (g % GROUPS) * GROUP;
float lo = float(rows[first]);
float hi = lo;
for (int j = 1; j < GROUP; j++) {
  float v = float(rows[first + j]);
  lo = min(lo, v);
  hi = max(hi, v);
}
P scale = P((hi - lo) / LEVELS);
P bias = P(lo);
float s = float(scale);
float b = float(bias);
float inv = s > 0.0f ? 1.0f / s : 0.0f;
for (int w = 0; w < GROUP / PER_WORD; w++) {
  uint word = 0;
  for (int e = 0; e < PER_WORD; e++) {
    float q = clamp(rint((float(rows[first + w * PER_WORD + e]) - b) * inv), 0.0f, LEVELS);
    word |= uint(q) << (e * BITS);
  }
  codes[first / PER_WORD + w] = word;
}
scales[g] = scale;
biases[g] = bias;
