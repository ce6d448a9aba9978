// The fused row kernels (kernels.hpp), written once for any vector width.
// Included by exactly one kernels_<isa>.cpp per instruction set, inside that
// file's anonymous namespace (so each TU's instantiations stay private to it:
// no inline function compiled for AVX-512 can be picked by the linker for the
// baseline table), after it defines:
//   kW               floats per vector;
//   vf, vd           float vector of kW lanes, double vector of kW / 2 lanes;
//   madd(a, b, c)    a * b + c for float and double vectors (FMA where the ISA has it);
//   to_double_lo/hi  the low/high kW / 2 floats of a vf as a vd;
//   stream(p, v)     non-temporal store of v at p (p aligned to sizeof(vf));
//   fence()          orders the non-temporal stores before later loads.
// The layer builds with -ffp-contract=off: `o += c * q` below stays a multiply
// then an add on every ISA, which makes reconstruct's bits the same on every table.
//
// Registers: ranks 1 to 8 are compile-time (accumulators in registers), larger
// ones take the rank at run time (R == 0; accumulators in memory, one
// coefficient loop per vector).

// Fully unrolled small loops keep the accumulator arrays below in registers
// (GCC at -O2 leaves them on the stack, a store and reload per vector).
#define PSGD_UNROLL _Pragma("GCC unroll 16")

template <int R>
constexpr size_t max_rank() {
  return R > 0 ? static_cast<size_t>(R) : size_t{64};  // kMaxOrthoCols
}

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);  // unaligned
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

template <bool Stream>
inline void put(float* p, vf v) {
  if constexpr (Stream)
    stream(p, v);
  else
    store(p, v);
}

// Elements before p + j reaches a vector boundary (non-temporal stores need one).
inline size_t head_of(const float* p, size_t n) {
  const auto misaligned = reinterpret_cast<uintptr_t>(p) % sizeof(vf);
  if (misaligned == 0) return 0;
  const size_t head = (sizeof(vf) - misaligned) / sizeof(float);
  return head < n ? head : n;
}

// Sum of squares in double: two vd chains per vector of floats.
struct SquareSum {
  vd lo{}, hi{};
  double scalar = 0.0;
  void add(vf x) {
    const vd l = to_double_lo(x), h = to_double_hi(x);
    lo = madd(l, l, lo);
    hi = madd(h, h, hi);
  }
  void add(float x) { scalar += static_cast<double>(x) * static_cast<double>(x); }
  double total() const {
    const vd s = lo + hi;
    double t = scalar;
    for (size_t l = 0; l < kW / 2; ++l) t += s[l];
    return t;
  }
};

// ---- form_project: m = a - b (or a), p_k = <m, qt_k>, one loop over the row ----

template <int R, bool HasB, bool Stream>
double form_project_row(float* m, const float* a, const float* b, const float* qt, size_t n, size_t rank, float* p) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  // Small ranks: two vectors per iteration, so that at least 4 product chains hide the FMA latency.
  constexpr int U = (R > 0 && R < 4) ? 2 : 1;
  vf acc[U][max_rank<R>()];
  float tail[max_rank<R>()];
  PSGD_UNROLL
  for (size_t k = 0; k < r; ++k) {
    PSGD_UNROLL
    for (int u = 0; u < U; ++u) acc[u][k] = vf{};
    tail[k] = 0.0f;
  }
  SquareSum sq[U];
  auto scalar = [&](size_t j) {
    const float x = HasB ? a[j] - b[j] : a[j];
    m[j] = x;
    sq[0].add(x);
    for (size_t k = 0; k < r; ++k) tail[k] += x * qt[k * n + j];
  };
  size_t j = 0;
  if constexpr (Stream)
    for (const size_t head = head_of(m, n); j < head; ++j) scalar(j);
  for (; j + U * kW <= n; j += U * kW) {
    vf x[U];
    PSGD_UNROLL
    for (int u = 0; u < U; ++u) {
      x[u] = load(a + j + u * kW);
      if constexpr (HasB) x[u] -= load(b + j + u * kW);
    }
    PSGD_UNROLL
    for (int u = 0; u < U; ++u) {
      put<Stream>(m + j + u * kW, x[u]);
      sq[u].add(x[u]);
      PSGD_UNROLL
      for (size_t k = 0; k < r; ++k) acc[u][k] = madd(x[u], load(qt + k * n + j + u * kW), acc[u][k]);
    }
  }
  for (; j < n; ++j) scalar(j);
  double total = 0.0;
  for (int u = 0; u < U; ++u) total += sq[u].total();
  for (size_t k = 0; k < r; ++k) {
    vf s = acc[0][k];
    for (int u = 1; u < U; ++u) s += acc[u][k];
    float t = tail[k];
    for (size_t l = 0; l < kW; ++l) t += s[l];
    p[k] = t;
  }
  return total;
}

template <int R, bool HasB, bool Stream>
double form_project_rows(float* m, const float* a, const float* b, size_t rows, size_t n, const float* qt,
                         size_t rank, float* p) {
  double total = 0.0;
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  for (size_t i = 0; i < rows; ++i)
    total += form_project_row<R, HasB, Stream>(m + i * n, a + i * n, HasB ? b + i * n : nullptr, qt, n, rank, p + i * r);
  return total;
}

// ---- project_cols: qt_k += sum_i p_i[k] m_i, Rows rows per sweep of the accumulators ----

template <int R, int Rows>
void accumulate_rows(float* qt, const float* m, const float* p, size_t n, size_t c0, size_t c1, size_t rank) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  // Local copies: stores through qt may alias p as far as the compiler knows.
  float coef[Rows][max_rank<R>()];
  for (int i = 0; i < Rows; ++i)
    for (size_t k = 0; k < r; ++k) coef[i][k] = p[static_cast<size_t>(i) * r + k];
  size_t j = c0;
  for (; j + kW <= c1; j += kW) {
    vf x[Rows];
    PSGD_UNROLL
    for (int i = 0; i < Rows; ++i) x[i] = load(m + static_cast<size_t>(i) * n + j);
    PSGD_UNROLL
    for (size_t k = 0; k < r; ++k) {
      vf t = load(qt + k * n + j);
      PSGD_UNROLL
      for (int i = 0; i < Rows; ++i) t = madd(splat(coef[i][k]), x[i], t);
      store(qt + k * n + j, t);
    }
  }
  for (; j < c1; ++j)
    for (size_t k = 0; k < r; ++k)
      for (int i = 0; i < Rows; ++i) qt[k * n + j] += coef[i][k] * m[static_cast<size_t>(i) * n + j];
}

template <int R>
void project_cols_impl(float* qt, const float* m, size_t rows, size_t n, size_t c0, size_t c1, const float* p,
                       size_t rank) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  // Column blocks keep the rank x block accumulators within L2 for very wide matrices.
  const size_t block = (size_t{64} << 10) / r;
  // More rows per sweep at small ranks: fewer accumulator loads and stores per element of M.
  constexpr int Rows = (R > 0 && R <= 2) ? 8 : 4;
  for (size_t b0 = c0; b0 < c1; b0 += block) {
    const size_t b1 = c1 - b0 > block ? b0 + block : c1;
    size_t i = 0;
    for (; i + Rows <= rows; i += Rows) accumulate_rows<R, Rows>(qt, m + i * n, p + i * r, n, b0, b1, r);
    for (; i < rows; ++i) accumulate_rows<R, 1>(qt, m + i * n, p + i * r, n, b0, b1, r);
  }
}

// ---- reconstruct: out = sum_k p[k] qt_k (in order k = 0, 1, ...), m = out - m ----

template <int R, bool Stream>
double reconstruct_row(float* out, float* m, const float* p, const float* qt, size_t n, size_t rank) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  float coef[max_rank<R>()];  // local: stores through out and m may alias p
  for (size_t k = 0; k < r; ++k) coef[k] = p[k];
  SquareSum sq;
  // The one formula of every element, vector lane or scalar: keep the two in step.
  auto scalar = [&](size_t j) {
    float o = 0.0f;
    for (size_t k = 0; k < r; ++k) o += coef[k] * qt[k * n + j];
    out[j] = o;
    const float d = o - m[j];
    m[j] = d;
    sq.add(d);
  };
  size_t j = 0;
  if constexpr (Stream)
    for (const size_t head = head_of(out, n); j < head; ++j) scalar(j);
  for (; j + kW <= n; j += kW) {
    vf o{};
    PSGD_UNROLL
    for (size_t k = 0; k < r; ++k) o += splat(coef[k]) * load(qt + k * n + j);
    put<Stream>(out + j, o);
    const vf d = o - load(m + j);
    store(m + j, d);
    sq.add(d);
  }
  for (; j < n; ++j) scalar(j);
  return sq.total();
}

template <int R, bool Stream>
double reconstruct_rows(float* out, float* m, size_t rows, size_t n, const float* p, const float* qt, size_t rank) {
  const size_t r = R > 0 ? static_cast<size_t>(R) : rank;
  double total = 0.0;
  for (size_t i = 0; i < rows; ++i) total += reconstruct_row<R, Stream>(out + i * n, m + i * n, p + i * r, qt, n, rank);
  return total;
}

// Calls body.template operator()<R>() with R = rank for ranks 1 to 8, else 0 (run time).
template <typename Body>
void with_rank(size_t rank, Body&& body) {
  switch (rank) {
    case 1: body.template operator()<1>(); break;
    case 2: body.template operator()<2>(); break;
    case 3: body.template operator()<3>(); break;
    case 4: body.template operator()<4>(); break;
    case 5: body.template operator()<5>(); break;
    case 6: body.template operator()<6>(); break;
    case 7: body.template operator()<7>(); break;
    case 8: body.template operator()<8>(); break;
    default: body.template operator()<0>(); break;
  }
}

double form_project_entry(float* m, const float* a, const float* b, size_t rows, size_t n, const float* qt,
                          size_t rank, float* p, bool stream) {
  double total = 0.0;
  with_rank(rank, [&]<int R>() {
    if (b != nullptr)
      total = stream ? form_project_rows<R, true, true>(m, a, b, rows, n, qt, rank, p)
                     : form_project_rows<R, true, false>(m, a, b, rows, n, qt, rank, p);
    else
      total = stream ? form_project_rows<R, false, true>(m, a, b, rows, n, qt, rank, p)
                     : form_project_rows<R, false, false>(m, a, b, rows, n, qt, rank, p);
  });
  return total;
}

void project_cols_entry(float* qt, const float* m, size_t rows, size_t n, size_t c0, size_t c1, const float* p,
                        size_t rank) {
  with_rank(rank, [&]<int R>() { project_cols_impl<R>(qt, m, rows, n, c0, c1, p, rank); });
}

double reconstruct_entry(float* out, float* m, size_t rows, size_t n, const float* p, const float* qt, size_t rank,
                         bool stream) {
  double total = 0.0;
  with_rank(rank, [&]<int R>() {
    total = stream ? reconstruct_rows<R, true>(out, m, rows, n, p, qt, rank)
                   : reconstruct_rows<R, false>(out, m, rows, n, p, qt, rank);
  });
  return total;
}
