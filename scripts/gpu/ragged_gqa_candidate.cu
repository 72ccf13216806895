// A candidate for mlx-sys/kernels/ragged_attention.cpp's kernel body, not
// yet wired in: checked on the CPU by scripts/gpu/check_kernels.sh (an
// emulation, in CI), to be timed by `attention_probe.py --candidate` on the
// GPU machine. Same inputs and output as the kernel in use (q and out
// [rows, heads * D]; k and v [rows, kv_heads, columns, D] with any strides
// but a packed last dimension; starts int32 [rows]; end int32 [1]; scale
// float32 [1]); template T, D and GQA (query heads per key/value head, at
// most 8). Launch: one block of 256 threads (eight warps) per (key/value
// head, row): grid (256 * kv_heads, rows, 1), threadgroup (256, 1, 1).
//
// Why: the kernel in use runs a block per query head, so each key/value
// head's columns are read GQA times (3x for Llama-3.2-3B, 4x for 8B), and
// its four warps walk the columns one at a time. Here a block reads each
// column once for all of its GQA query heads, and eight warps share the
// columns.
  constexpr int WARPS = 8;
  constexpr int PER = D / 32;
  const int kv_head = blockIdx.x;
  const int row = blockIdx.y;
  const int kv_heads = gridDim.x;
  const int heads = kv_heads * GQA;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int last = end[0];
  const int first = starts[row];
  const float s = scale[0];
  float qv[GQA][PER];
  for (int g = 0; g < GQA; g++) {
    const T* qp = q + ((size_t)row * heads + kv_head * GQA + g) * D + lane * PER;
    for (int i = 0; i < PER; i++) {
      qv[g][i] = static_cast<float>(qp[i]) * s;
    }
  }
  const T* kp = k + row * k_strides[0] + kv_head * k_strides[1] + lane * PER;
  const T* vp = v + row * v_strides[0] + kv_head * v_strides[1] + lane * PER;
  float m[GQA];
  float l[GQA];
  float acc[GQA][PER];
  for (int g = 0; g < GQA; g++) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int i = 0; i < PER; i++) {
      acc[g][i] = 0.0f;
    }
  }
  for (int j = first + warp; j <= last; j += WARPS) {
    const T* kj = kp + j * k_strides[2];
    const T* vj = vp + j * v_strides[2];
    float kf[PER];
    float vf[PER];
    for (int i = 0; i < PER; i++) {
      kf[i] = static_cast<float>(kj[i]);
      vf[i] = static_cast<float>(vj[i]);
    }
    float score[GQA];
    for (int g = 0; g < GQA; g++) {
      score[g] = 0.0f;
      for (int i = 0; i < PER; i++) {
        score[g] += qv[g][i] * kf[i];
      }
    }
    for (int o = 16; o > 0; o /= 2) {
      for (int g = 0; g < GQA; g++) {
        score[g] += __shfl_xor_sync(0xffffffff, score[g], o);
      }
    }
    for (int g = 0; g < GQA; g++) {
      const float m_new = fmaxf(m[g], score[g]);
      const float kept = __expf(m[g] - m_new);
      const float p = __expf(score[g] - m_new);
      l[g] = l[g] * kept + p;
      for (int i = 0; i < PER; i++) {
        acc[g][i] = acc[g][i] * kept + p * vf[i];
      }
      m[g] = m_new;
    }
  }
  __shared__ float warp_m[WARPS][GQA];
  __shared__ float warp_l[WARPS][GQA];
  __shared__ float warp_acc[WARPS][D];
  if (lane == 0) {
    for (int g = 0; g < GQA; g++) {
      warp_m[warp][g] = m[g];
      warp_l[warp][g] = l[g];
    }
  }
  // One query head at a time: the warps' partial sums, merged by warp 0.
  for (int g = 0; g < GQA; g++) {
    __syncthreads();
    for (int i = 0; i < PER; i++) {
      warp_acc[warp][lane * PER + i] = acc[g][i];
    }
    __syncthreads();
    if (warp == 0) {
      float top = -INFINITY;
      for (int w = 0; w < WARPS; w++) {
        top = fmaxf(top, warp_m[w][g]);
      }
      float total = 0.0f;
      float o[PER];
      for (int i = 0; i < PER; i++) {
        o[i] = 0.0f;
      }
      for (int w = 0; w < WARPS; w++) {
        const float c = warp_m[w][g] == -INFINITY ? 0.0f : __expf(warp_m[w][g] - top);
        total += warp_l[w][g] * c;
        for (int i = 0; i < PER; i++) {
          o[i] += warp_acc[w][lane * PER + i] * c;
        }
      }
      T* op = out + ((size_t)row * heads + kv_head * GQA + g) * D + lane * PER;
      for (int i = 0; i < PER; i++) {
        op[i] = static_cast<T>(o[i] / total);
      }
    }
  }
