// Merges the key splits of paged attention: one thread per (value d, head, token).
// part_o (tokens, heads, splits, D) holds unnormalized sums, part_ml (tokens, heads, splits, 2)
// each split's running maximum and softmax denominator.
const int d = int(thread_position_in_grid.x);
const int head = int(thread_position_in_grid.y);
const int token = int(thread_position_in_grid.z);
const int heads = part_ml_shape[1];
const int num_splits = part_ml_shape[2];
const int row = (token * heads + head) * num_splits;
float m = -1e30f;
for (int s = 0; s < num_splits; s++) {
  m = max(m, part_ml[(row + s) * 2]);
}
float l = 0.0f;
float acc = 0.0f;
for (int s = 0; s < num_splits; s++) {
  float w = exp(part_ml[(row + s) * 2] - m);
  l += part_ml[(row + s) * 2 + 1] * w;
  acc += part_o[(row + s) * D + d] * w;
}
out[(token * heads + head) * D + d] = T(l > 0.0f ? acc / l : 0.0f);
