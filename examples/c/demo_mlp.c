/* SPDX-License-Identifier: MIT
 *
 * demo_mlp.c — libdion's main demo: AdamW vs Muon vs Dion on a small but real model.
 *
 * A two-layer tanh MLP "student" (64 -> 256 -> 32, with biases) learns a fixed random
 * "teacher" MLP (64 -> 128 -> 32, tanh, with biases) by mean-squared-error regression, on the
 * HOST backend. Every step draws a fresh minibatch of 128 inputs. The inputs are correlated:
 * x = U diag(sigma) z with z ~ N(0, I), U a random rotation and sigma spaced geometrically from
 * 1 down to 1/1000, i.e. ill-conditioned features in no particular basis, as real data has.
 * The same initialised student is trained three times, in lockstep, on the very same minibatches:
 *
 *   adamw : one libdion optimizer, one group: AdamW for all four tensors
 *   muon  : one optimizer, two groups: Muon for W1 and W2, AdamW for b1 and b2
 *   dion  : one optimizer, two groups: Dion (rank_fraction 0.5) for W1 and W2, AdamW for b1 and b2
 *
 * This is the usual grouping: matrices go to an orthonormal optimizer, and biases and other
 * vectors to an element-wise one. Every K steps the demo prints, as one row of a table, each
 * run's loss on a fixed held-out batch of 1024 inputs. A last line names the optimizer that
 * reached the lowest held-out loss. The teacher's outputs are normalised to unit variance, so a
 * loss of 1.0 means "predicts nothing" and the student, wider than the teacher, can reach 0.
 *
 * Learning rates. The lr is constant, then decays linearly to 0 over the last 30% of the steps
 * (dion_group_set_hparam before every step). Weight decay is 0 everywhere. Every other
 * hyperparameter is libdion's default, which is microsoft/dion's: AdamW betas (0.9, 0.95), Muon
 * momentum 0.95, Dion mu 0.95, and Muon's lr * sqrt(fan_out/fan_in) / Dion's lr * sqrt(m/n)
 * scaling. Each lr is the best of a sweep, run the same way for every optimizer (1000 steps,
 * final held-out loss, seeds 1-3, every seed picking the same value):
 *
 *   adamw : lr 2e-2 for all params            (swept 5e-3, 1e-2, 2e-2, 3e-2, 5e-2;
 *                                              beta2 0.999 was worse at every lr)
 *   muon  : lr 1e-2 for W1, W2; biases 2e-2   (swept 5e-3, 7.5e-3, 1e-2, 1.5e-2, 2e-2, 3e-2)
 *   dion  : lr 1.5e-2 for W1, W2; biases 2e-2 (swept the same values as muon)
 *
 * The bias lr of the Muon and Dion runs is AdamW's best lr, so the three runs differ only in how
 * the two weight matrices are updated. --lr-adamw, --lr-muon and --lr-dion override the lrs.
 *
 * Only <dion.h>, libc and libm: the forward and backward passes are plain loops.
 *
 * Build: the CMake target dion-demo (build/dion-demo), or by hand:
 *   gcc -std=c99 -O2 -Iinclude examples/c/demo_mlp.c -Lbuild -ldion -lm -Wl,-rpath,$PWD/build -o dion-demo
 * Run:
 *   ./dion-demo [--steps N] [--every K] [--quiet] [--seed S] [--lr-adamw X] [--lr-muon X] [--lr-dion X]
 *               [--rank-fraction F]
 */
#include <dion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Problem sizes and defaults                                               */
/* ------------------------------------------------------------------------ */

enum {
  N_IN = 64,        /* input features */
  N_HID = 256,      /* student hidden units */
  N_OUT = 32,       /* outputs */
  BATCH = 128,      /* training minibatch (fresh inputs every step) */
  EVAL_BATCH = 1024 /* fixed held-out batch for the printed loss */
};

#define DEFAULT_STEPS 1000
#define DEFAULT_LR_ADAMW 2e-2
#define DEFAULT_LR_MUON 1e-2
#define DEFAULT_LR_DION 1.5e-2
#define DEFAULT_RANK_FRACTION 0.5
#define DECAY_FRACTION 0.3 /* linear decay to 0 over the last 30% of the steps */
#define T_HID 128          /* teacher hidden units */
#define TEACHER_GAIN 2.0   /* teacher's first-layer weights ~ N(0, gain^2 / N_IN): clearly nonlinear */
#define INPUT_COND 1000.0  /* ratio of the largest to the smallest input standard deviation */

/* Examples may exit on error (libraries may not): print the status and the handle's last error. */
#define CHECK(opt, call)                                                                                  \
  do {                                                                                                    \
    dion_status_t st_ = (call);                                                                           \
    if (st_ != DION_SUCCESS) {                                                                            \
      fprintf(stderr, "%s:%d: %s failed: %s\n  %s\n", __FILE__, __LINE__, #call, dion_status_string(st_), \
              dion_last_error(opt));                                                                      \
      exit(1);                                                                                            \
    }                                                                                                     \
  } while (0)

static void* xcalloc(size_t n, size_t size) {
  void* p = calloc(n, size);
  if (p == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return p;
}

/* ------------------------------------------------------------------------ */
/* A small deterministic generator (splitmix64) and Gaussian samples        */
/* ------------------------------------------------------------------------ */

typedef struct {
  uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t* r) {
  uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in (0, 1). */
static double rng_uniform(rng_t* r) { return ((double)(rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static double rng_normal(rng_t* r) {
  const double two_pi = 6.283185307179586;
  return sqrt(-2.0 * log(rng_uniform(r))) * cos(two_pi * rng_uniform(r));
}

static void fill_normal(rng_t* r, float* x, size_t n, double std) {
  size_t i;
  for (i = 0; i < n; ++i) x[i] = (float)(std * rng_normal(r));
}

static void fill_uniform(rng_t* r, float* x, size_t n, double bound) {
  size_t i;
  for (i = 0; i < n; ++i) x[i] = (float)(bound * (2.0 * rng_uniform(r) - 1.0));
}

/* ------------------------------------------------------------------------ */
/* Dense kernels (row-major; W is fan_out x fan_in as torch.nn.Linear)      */
/* ------------------------------------------------------------------------ */

/* The loops below walk the contiguous dimension in chunks of LANES with one accumulator per lane
 * and `restrict` pointers: a fixed-trip-count inner loop with no aliasing is what GCC/Clang
 * vectorize at plain -O2 (no -ffast-math needed), which makes the demo about twice as fast as
 * naive loops. Every dimension used here is a multiple of LANES. */
#define LANES 8

/* tanh through one expf: glibc's tanhf is several times slower and was half of the demo's run
 * time. Absolute error ~1e-7; |x| is clamped where tanh is 1 to float precision. */
static float fast_tanhf(float x) {
  float e;
  if (x > 10.f) x = 10.f;
  if (x < -10.f) x = -10.f;
  e = expf(2.f * x);
  return (e - 1.f) / (e + 1.f);
}

/* Y[b, o] = act(sum_i X[b, i] * W[o, i] + bias[o]), act = tanh if `use_tanh`. */
static void linear_forward(const float* restrict X, const float* restrict W, const float* restrict bias,
                           float* restrict Y, int batch, int n_in, int n_out, int use_tanh) {
  int b, o, i, u;
  for (b = 0; b < batch; ++b) {
    const float* x = X + (size_t)b * n_in;
    float* y = Y + (size_t)b * n_out;
    for (o = 0; o < n_out; ++o) {
      const float* w = W + (size_t)o * n_in;
      float acc[LANES] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float s;
      for (i = 0; i < n_in; i += LANES)
        for (u = 0; u < LANES; ++u) acc[u] += x[i + u] * w[i + u];
      s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + bias[o];
      y[o] = use_tanh ? fast_tanhf(s) : s;
    }
  }
}

/* dW[o, i] = sum_b dY[b, o] * X[b, i];  dbias[o] = sum_b dY[b, o];
 * if dX != NULL: dX[b, i] = sum_o dY[b, o] * W[o, i]. */
static void linear_backward(const float* restrict X, const float* restrict W, const float* restrict dY,
                            float* restrict dW, float* restrict dbias, float* restrict dX, int batch, int n_in,
                            int n_out) {
  int b, o, i, u;
  memset(dW, 0, sizeof(float) * (size_t)n_out * n_in);
  memset(dbias, 0, sizeof(float) * (size_t)n_out);
  if (dX != NULL) memset(dX, 0, sizeof(float) * (size_t)batch * n_in);
  for (b = 0; b < batch; ++b) {
    const float* x = X + (size_t)b * n_in;
    const float* dy = dY + (size_t)b * n_out;
    for (o = 0; o < n_out; ++o) {
      const float d = dy[o];
      float* dw = dW + (size_t)o * n_in;
      dbias[o] += d;
      for (i = 0; i < n_in; i += LANES)
        for (u = 0; u < LANES; ++u) dw[i + u] += d * x[i + u];
    }
    if (dX != NULL) {
      float* dx = dX + (size_t)b * n_in;
      for (o = 0; o < n_out; ++o) {
        const float d = dy[o];
        const float* w = W + (size_t)o * n_in;
        for (i = 0; i < n_in; i += LANES)
          for (u = 0; u < LANES; ++u) dx[i + u] += d * w[i + u];
      }
    }
  }
}

/* ------------------------------------------------------------------------ */
/* The models                                                               */
/* ------------------------------------------------------------------------ */

/* Student: parameters, their gradients, and activation buffers for one training batch. */
typedef struct {
  float *W1, *b1, *W2, *b2;     /* N_HID x N_IN, N_HID, N_OUT x N_HID, N_OUT */
  float *gW1, *gb1, *gW2, *gb2; /* gradients, same shapes (the optimizer reads these) */
  float *H, *Y, *dY, *dH;       /* BATCH x N_HID, BATCH x N_OUT, BATCH x N_OUT, BATCH x N_HID */
} mlp_t;

static void mlp_alloc(mlp_t* m) {
  m->W1 = (float*)xcalloc((size_t)N_HID * N_IN, sizeof(float));
  m->b1 = (float*)xcalloc(N_HID, sizeof(float));
  m->W2 = (float*)xcalloc((size_t)N_OUT * N_HID, sizeof(float));
  m->b2 = (float*)xcalloc(N_OUT, sizeof(float));
  m->gW1 = (float*)xcalloc((size_t)N_HID * N_IN, sizeof(float));
  m->gb1 = (float*)xcalloc(N_HID, sizeof(float));
  m->gW2 = (float*)xcalloc((size_t)N_OUT * N_HID, sizeof(float));
  m->gb2 = (float*)xcalloc(N_OUT, sizeof(float));
  m->H = (float*)xcalloc((size_t)EVAL_BATCH * N_HID, sizeof(float)); /* sized for the eval batch too */
  m->Y = (float*)xcalloc((size_t)EVAL_BATCH * N_OUT, sizeof(float));
  m->dY = (float*)xcalloc((size_t)BATCH * N_OUT, sizeof(float));
  m->dH = (float*)xcalloc((size_t)BATCH * N_HID, sizeof(float));
}

static void mlp_free(mlp_t* m) {
  free(m->W1), free(m->b1), free(m->W2), free(m->b2);
  free(m->gW1), free(m->gb1), free(m->gW2), free(m->gb2);
  free(m->H), free(m->Y), free(m->dY), free(m->dH);
}

/* PyTorch's nn.Linear initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases. */
static void mlp_init(mlp_t* m, rng_t* r) {
  fill_uniform(r, m->W1, (size_t)N_HID * N_IN, 1.0 / sqrt((double)N_IN));
  fill_uniform(r, m->b1, N_HID, 1.0 / sqrt((double)N_IN));
  fill_uniform(r, m->W2, (size_t)N_OUT * N_HID, 1.0 / sqrt((double)N_HID));
  fill_uniform(r, m->b2, N_OUT, 1.0 / sqrt((double)N_HID));
}

static void mlp_copy_params(mlp_t* dst, const mlp_t* src) {
  memcpy(dst->W1, src->W1, sizeof(float) * (size_t)N_HID * N_IN);
  memcpy(dst->b1, src->b1, sizeof(float) * N_HID);
  memcpy(dst->W2, src->W2, sizeof(float) * (size_t)N_OUT * N_HID);
  memcpy(dst->b2, src->b2, sizeof(float) * N_OUT);
}

/* Forward pass over `batch` rows of X into m->H, m->Y; returns the MSE against T (mean over
 * batch * N_OUT entries). */
static double mlp_forward(mlp_t* m, const float* X, const float* T, int batch) {
  size_t k, n = (size_t)batch * N_OUT;
  double loss = 0.0;
  linear_forward(X, m->W1, m->b1, m->H, batch, N_IN, N_HID, 1);
  linear_forward(m->H, m->W2, m->b2, m->Y, batch, N_HID, N_OUT, 0);
  for (k = 0; k < n; ++k) {
    const double e = (double)m->Y[k] - (double)T[k];
    loss += e * e;
  }
  return loss / (double)n;
}

/* Forward + backward on one training batch: fills the gradients, returns the training loss. */
static double mlp_forward_backward(mlp_t* m, const float* X, const float* T) {
  const size_t n = (size_t)BATCH * N_OUT;
  const float scale = 2.0f / (float)n; /* d(mean of squares)/dY */
  size_t k;
  const double loss = mlp_forward(m, X, T, BATCH);
  for (k = 0; k < n; ++k) m->dY[k] = scale * (m->Y[k] - T[k]);
  linear_backward(m->H, m->W2, m->dY, m->gW2, m->gb2, m->dH, BATCH, N_HID, N_OUT);
  for (k = 0; k < (size_t)BATCH * N_HID; ++k) m->dH[k] *= 1.0f - m->H[k] * m->H[k]; /* tanh' */
  linear_backward(X, m->W1, m->dH, m->gW1, m->gb1, NULL, BATCH, N_IN, N_HID);
  return loss;
}

/* Inputs: x = A z with z ~ N(0, I) and A = U diag(sigma) for a random orthogonal U and standard
 * deviations sigma spaced geometrically from 1 down to 1/INPUT_COND (rescaled so that E|x|^2 = N_IN).
 * Correlated, ill-conditioned features in no particular basis, as real data has. A is stored
 * transposed (N_IN x N_IN, row k = sigma_k * column k of U) so that X = Z A^T is a sum of rows. */
static float* make_input_mixing(rng_t* r) {
  double* U = (double*)xcalloc((size_t)N_IN * N_IN, sizeof(double));
  float* At = (float*)xcalloc((size_t)N_IN * N_IN, sizeof(float));
  double sigma[N_IN], norm2 = 0.0;
  int i, j, k, pass;
  for (k = 0; k < N_IN * N_IN; ++k) U[k] = rng_normal(r);
  /* Modified Gram-Schmidt, twice, on the columns of U. */
  for (pass = 0; pass < 2; ++pass) {
    for (j = 0; j < N_IN; ++j) {
      double d, nrm = 0.0;
      for (k = 0; k < j; ++k) {
        for (d = 0.0, i = 0; i < N_IN; ++i) d += U[i * N_IN + k] * U[i * N_IN + j];
        for (i = 0; i < N_IN; ++i) U[i * N_IN + j] -= d * U[i * N_IN + k];
      }
      for (i = 0; i < N_IN; ++i) nrm += U[i * N_IN + j] * U[i * N_IN + j];
      nrm = sqrt(nrm);
      for (i = 0; i < N_IN; ++i) U[i * N_IN + j] /= nrm;
    }
  }
  for (k = 0; k < N_IN; ++k) {
    sigma[k] = pow(INPUT_COND, -(double)k / (N_IN - 1));
    norm2 += sigma[k] * sigma[k];
  }
  for (k = 0; k < N_IN; ++k) {
    const double sk = sigma[k] * sqrt(N_IN / norm2);
    for (i = 0; i < N_IN; ++i) At[k * N_IN + i] = (float)(sk * U[i * N_IN + k]);
  }
  free(U);
  return At;
}

/* `batch` fresh inputs: X = Z A^T, Z standard normal (Z is scratch of the same size). */
static void sample_inputs(rng_t* r, const float* restrict At, float* restrict Z, float* restrict X, int batch) {
  int b, k, i, u;
  fill_normal(r, Z, (size_t)batch * N_IN, 1.0);
  memset(X, 0, sizeof(float) * (size_t)batch * N_IN);
  for (b = 0; b < batch; ++b) {
    const float* z = Z + (size_t)b * N_IN;
    float* x = X + (size_t)b * N_IN;
    for (k = 0; k < N_IN; ++k) {
      const float zk = z[k];
      const float* a = At + (size_t)k * N_IN;
      for (i = 0; i < N_IN; i += LANES)
        for (u = 0; u < LANES; ++u) x[i + u] += zk * a[i + u];
    }
  }
}

/* Teacher: a different random MLP; its outputs are the regression targets. */
typedef struct {
  float *W1, *b1, *W2, *b2; /* T_HID x N_IN, T_HID, N_OUT x T_HID, N_OUT */
  float* H;                 /* EVAL_BATCH x T_HID scratch */
} teacher_t;

static void teacher_forward(teacher_t* t, const float* X, float* T, int batch) {
  linear_forward(X, t->W1, t->b1, t->H, batch, N_IN, T_HID, 1);
  linear_forward(t->H, t->W2, t->b2, T, batch, T_HID, N_OUT, 0);
}

static void teacher_init(teacher_t* t, rng_t* r, const float* At) {
  float *X, *Z, *T;
  double mean = 0.0, var = 0.0, s;
  size_t k, n = (size_t)EVAL_BATCH * N_OUT;
  t->W1 = (float*)xcalloc((size_t)T_HID * N_IN, sizeof(float));
  t->b1 = (float*)xcalloc(T_HID, sizeof(float));
  t->W2 = (float*)xcalloc((size_t)N_OUT * T_HID, sizeof(float));
  t->b2 = (float*)xcalloc(N_OUT, sizeof(float));
  t->H = (float*)xcalloc((size_t)EVAL_BATCH * T_HID, sizeof(float));
  fill_normal(r, t->W1, (size_t)T_HID * N_IN, TEACHER_GAIN / sqrt((double)N_IN));
  fill_normal(r, t->b1, T_HID, 0.5);
  fill_normal(r, t->W2, (size_t)N_OUT * T_HID, 1.0 / sqrt((double)T_HID));
  fill_normal(r, t->b2, N_OUT, 0.5);
  /* Normalise the teacher so that its outputs have unit variance (over inputs and outputs):
   * a loss of 1.0 then means "explains nothing" whatever the random draw. */
  X = (float*)xcalloc((size_t)EVAL_BATCH * N_IN, sizeof(float));
  Z = (float*)xcalloc((size_t)EVAL_BATCH * N_IN, sizeof(float));
  T = (float*)xcalloc(n, sizeof(float));
  sample_inputs(r, At, Z, X, EVAL_BATCH);
  teacher_forward(t, X, T, EVAL_BATCH);
  for (k = 0; k < n; ++k) mean += T[k];
  mean /= (double)n;
  for (k = 0; k < n; ++k) var += (T[k] - mean) * (T[k] - mean);
  var /= (double)n;
  s = 1.0 / sqrt(var);
  for (k = 0; k < (size_t)N_OUT * T_HID; ++k) t->W2[k] = (float)(s * t->W2[k]);
  for (k = 0; k < N_OUT; ++k) t->b2[k] = (float)(s * t->b2[k]);
  free(X);
  free(Z);
  free(T);
}

static void teacher_free(teacher_t* t) { free(t->W1), free(t->b1), free(t->W2), free(t->b2), free(t->H); }

/* ------------------------------------------------------------------------ */
/* libdion setup                                                            */
/* ------------------------------------------------------------------------ */

enum { RUN_ADAMW = 0, RUN_MUON = 1, RUN_DION = 2, N_RUNS = 3 };
static const char* const kRunNames[N_RUNS] = {"adamw", "muon", "dion"};

static dion_tensor_t make_tensor(const char* name, float* param, const float* grad, int64_t rows, int64_t cols) {
  dion_tensor_t t;
  CHECK(NULL, dion_tensor_init(&t));
  t.name = name;
  t.param = param;
  t.grad = grad;
  t.param_dtype = DION_DTYPE_FP32;
  if (cols > 0) {
    t.ndim = 2;
    t.shape[0] = rows; /* fan_out */
    t.shape[1] = cols; /* fan_in */
  } else {
    t.ndim = 1;
    t.shape[0] = rows;
  }
  return t;
}

typedef struct {
  dion_optimizer_t opt;
  int32_t group[2]; /* group indices; group[1] = -1 when there is one group */
  double lr[2];     /* base lr of each group (the schedule multiplies it) */
} run_t;

/* One optimizer per run: AdamW everywhere, or `matrix_algo` for W1/W2 plus AdamW for b1/b2. */
static void make_optimizer(run_t* run, mlp_t* m, int which, double lr_adamw, double lr_matrix, double rank_fraction) {
  dion_options_t options;
  dion_group_options_t g;
  dion_tensor_t mats[2], vecs[2], all[4];

  CHECK(NULL, dion_options_init(&options));
  options.backend = DION_BACKEND_HOST;
  options.seed = 1234;
  CHECK(NULL, dion_create(&run->opt, &options));

  mats[0] = make_tensor("W1", m->W1, m->gW1, N_HID, N_IN);
  mats[1] = make_tensor("W2", m->W2, m->gW2, N_OUT, N_HID);
  vecs[0] = make_tensor("b1", m->b1, m->gb1, N_HID, 0);
  vecs[1] = make_tensor("b2", m->b2, m->gb2, N_OUT, 0);

  run->group[1] = -1;
  if (which == RUN_ADAMW) {
    all[0] = mats[0], all[1] = vecs[0], all[2] = mats[1], all[3] = vecs[1];
    CHECK(NULL, dion_group_options_init(&g, DION_ALGO_ADAMW));
    g.lr = lr_adamw;
    g.weight_decay = 0.0;
    CHECK(run->opt, dion_add_group(run->opt, &g, all, 4, &run->group[0]));
    run->lr[0] = lr_adamw;
    return;
  }

  /* Group 0: the two weight matrices with Muon or Dion. */
  CHECK(NULL, dion_group_options_init(&g, which == RUN_MUON ? DION_ALGO_MUON : DION_ALGO_DION));
  g.lr = lr_matrix;
  g.weight_decay = 0.0;
  if (which == RUN_DION) g.rank_fraction = rank_fraction;
  CHECK(run->opt, dion_add_group(run->opt, &g, mats, 2, &run->group[0]));
  run->lr[0] = lr_matrix;

  /* Group 1: the biases with AdamW, at AdamW's lr. */
  CHECK(NULL, dion_group_options_init(&g, DION_ALGO_ADAMW));
  g.lr = lr_adamw;
  g.weight_decay = 0.0;
  CHECK(run->opt, dion_add_group(run->opt, &g, vecs, 2, &run->group[1]));
  run->lr[1] = lr_adamw;
}

/* Constant, then linear decay to 0 over the last DECAY_FRACTION of the steps. */
static double lr_factor(int step, int steps) {
  const double decay_start = (1.0 - DECAY_FRACTION) * steps;
  if (step < decay_start) return 1.0;
  return (steps - step) / (steps - decay_start);
}

/* ------------------------------------------------------------------------ */
/* main                                                                     */
/* ------------------------------------------------------------------------ */

static void usage(const char* argv0) {
  fprintf(stderr,
          "usage: %s [--steps N] [--every K] [--quiet] [--seed S]\n"
          "          [--lr-adamw X] [--lr-muon X] [--lr-dion X] [--rank-fraction F]\n"
          "  --steps N          training steps (default %d)\n"
          "  --every K          print the held-out loss every K steps (default steps/20)\n"
          "  --quiet            print only the final losses and the summary line\n"
          "  --seed S           seed of the teacher, the student and the data (default 1)\n"
          "  --lr-adamw X       AdamW lr (all params of the adamw run, biases of the others; default %g)\n"
          "  --lr-muon X        Muon lr for W1, W2 (default %g)\n"
          "  --lr-dion X        Dion lr for W1, W2 (default %g)\n"
          "  --rank-fraction F  Dion rank fraction (default %g)\n",
          argv0, DEFAULT_STEPS, DEFAULT_LR_ADAMW, DEFAULT_LR_MUON, DEFAULT_LR_DION, DEFAULT_RANK_FRACTION);
}

static double parse_double(const char* s, const char* flag) {
  char* end;
  double v = strtod(s, &end);
  if (end == s || *end != '\0' || !(v >= 0.0) || v > 1e6) {
    fprintf(stderr, "bad value for %s: '%s'\n", flag, s);
    exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  int steps = DEFAULT_STEPS, every = 0, quiet = 0, step, r, a;
  uint64_t seed = 1;
  double lr_adamw = DEFAULT_LR_ADAMW, lr_muon = DEFAULT_LR_MUON, lr_dion = DEFAULT_LR_DION;
  double rank_fraction = DEFAULT_RANK_FRACTION;
  double eval_loss[N_RUNS];
  int winner;
  rng_t rng_model, rng_data, rng_eval;
  teacher_t teacher;
  mlp_t init, model[N_RUNS];
  run_t run[N_RUNS];
  float *X, *T, *Xe, *Te, *Z, *At;
  int64_t skipped;
  int32_t last_skipped;

  for (a = 1; a < argc; ++a) {
    const char* f = argv[a];
    const int has_value = a + 1 < argc;
    if (strcmp(f, "--quiet") == 0 || strcmp(f, "-q") == 0) {
      quiet = 1;
    } else if (strcmp(f, "--help") == 0 || strcmp(f, "-h") == 0) {
      usage(argv[0]);
      return 0;
    } else if (has_value && strcmp(f, "--steps") == 0) {
      steps = (int)parse_double(argv[++a], f);
    } else if (has_value && strcmp(f, "--every") == 0) {
      every = (int)parse_double(argv[++a], f);
    } else if (has_value && strcmp(f, "--seed") == 0) {
      seed = (uint64_t)parse_double(argv[++a], f);
    } else if (has_value && strcmp(f, "--lr-adamw") == 0) {
      lr_adamw = parse_double(argv[++a], f);
    } else if (has_value && strcmp(f, "--lr-muon") == 0) {
      lr_muon = parse_double(argv[++a], f);
    } else if (has_value && strcmp(f, "--lr-dion") == 0) {
      lr_dion = parse_double(argv[++a], f);
    } else if (has_value && strcmp(f, "--rank-fraction") == 0) {
      rank_fraction = parse_double(argv[++a], f);
    } else {
      usage(argv[0]);
      return 2;
    }
  }
  if (steps < 1) {
    fprintf(stderr, "--steps must be at least 1\n");
    return 2;
  }
  if (every < 1) every = steps >= 20 ? steps / 20 : 1;

  if (dion_version() / 10000 != DION_VERSION_MAJOR) {
    fprintf(stderr, "libdion major version mismatch: header %d, library %d\n", DION_VERSION_MAJOR,
            (int)(dion_version() / 10000));
    return 1;
  }

  /* Three independent streams: model init, training data, held-out data. */
  rng_model.s = seed * 0x100000001B3ull + 1;
  rng_data.s = seed * 0x100000001B3ull + 2;
  rng_eval.s = seed * 0x100000001B3ull + 3;

  At = make_input_mixing(&rng_model);
  teacher_init(&teacher, &rng_model, At);
  mlp_alloc(&init);
  mlp_init(&init, &rng_model);
  for (r = 0; r < N_RUNS; ++r) {
    mlp_alloc(&model[r]);
    mlp_copy_params(&model[r], &init); /* the same initialised student, three times */
  }
  make_optimizer(&run[RUN_ADAMW], &model[RUN_ADAMW], RUN_ADAMW, lr_adamw, 0.0, 0.0);
  make_optimizer(&run[RUN_MUON], &model[RUN_MUON], RUN_MUON, lr_adamw, lr_muon, 0.0);
  make_optimizer(&run[RUN_DION], &model[RUN_DION], RUN_DION, lr_adamw, lr_dion, rank_fraction);

  X = (float*)xcalloc((size_t)BATCH * N_IN, sizeof(float));
  T = (float*)xcalloc((size_t)BATCH * N_OUT, sizeof(float));
  Xe = (float*)xcalloc((size_t)EVAL_BATCH * N_IN, sizeof(float));
  Te = (float*)xcalloc((size_t)EVAL_BATCH * N_OUT, sizeof(float));
  Z = (float*)xcalloc((size_t)EVAL_BATCH * N_IN, sizeof(float));
  sample_inputs(&rng_eval, At, Z, Xe, EVAL_BATCH);
  teacher_forward(&teacher, Xe, Te, EVAL_BATCH);

  if (!quiet) {
    printf("libdion %d.%d.%d demo: MLP %d-%d-%d (tanh) learning a random %d-%d-%d teacher, batch %d, %d steps\n",
           (int)(dion_version() / 10000), (int)(dion_version() / 100 % 100), (int)(dion_version() % 100), N_IN, N_HID,
           N_OUT, N_IN, T_HID, N_OUT, BATCH, steps);
    printf("  adamw: AdamW lr %g (all params)\n", lr_adamw);
    printf("  muon : Muon lr %g (W1, W2) + AdamW lr %g (b1, b2)\n", lr_muon, lr_adamw);
    printf("  dion : Dion lr %g, rank_fraction %g (W1, W2) + AdamW lr %g (b1, b2)\n", lr_dion, rank_fraction, lr_adamw);
    printf("held-out MSE on %d inputs (teacher output variance = 1):\n\n", EVAL_BATCH);
    printf("%8s  %10s  %10s  %10s\n", "step", kRunNames[0], kRunNames[1], kRunNames[2]);
  }

  for (step = 0; step <= steps; ++step) {
    /* Evaluate (before the update of this step; step 0 is the initial model). */
    if (step % every == 0 || step == steps) {
      for (r = 0; r < N_RUNS; ++r) eval_loss[r] = mlp_forward(&model[r], Xe, Te, EVAL_BATCH);
      if (!quiet) printf("%8d  %10.3e  %10.3e  %10.3e\n", step, eval_loss[0], eval_loss[1], eval_loss[2]);
    }
    if (step == steps) break;

    /* One fresh minibatch, shared by the three runs. */
    sample_inputs(&rng_data, At, Z, X, BATCH);
    teacher_forward(&teacher, X, T, BATCH);
    for (r = 0; r < N_RUNS; ++r) {
      int gi;
      const double f = lr_factor(step, steps);
      mlp_forward_backward(&model[r], X, T);
      for (gi = 0; gi < 2 && run[r].group[gi] >= 0; ++gi)
        CHECK(run[r].opt, dion_group_set_hparam(run[r].opt, run[r].group[gi], DION_HPARAM_LR, f * run[r].lr[gi]));
      CHECK(run[r].opt, dion_step(run[r].opt, NULL));
    }
  }

  /* The losses printed at the last step decide the winner. */
  winner = 0;
  for (r = 1; r < N_RUNS; ++r)
    if (eval_loss[r] < eval_loss[winner]) winner = r;
  for (r = 0; r < N_RUNS; ++r) {
    CHECK(run[r].opt, dion_get_skipped_steps(run[r].opt, &skipped, &last_skipped, NULL));
    if (skipped != 0)
      printf("warning: %s skipped %lld steps with non-finite gradients\n", kRunNames[r], (long long)skipped);
  }
  if (!quiet) printf("\n");
  printf("final held-out loss after %d steps: adamw %.3e, muon %.3e, dion %.3e\n", steps, eval_loss[0], eval_loss[1],
         eval_loss[2]);
  printf("lowest loss: %s (%.3e); loss ratio adamw/muon %.1f, adamw/dion %.1f\n", kRunNames[winner], eval_loss[winner],
         eval_loss[RUN_ADAMW] / eval_loss[RUN_MUON], eval_loss[RUN_ADAMW] / eval_loss[RUN_DION]);

  for (r = 0; r < N_RUNS; ++r) {
    CHECK(NULL, dion_destroy(run[r].opt)); /* the handle is gone: no dion_last_error(handle) after this */
    mlp_free(&model[r]);
  }
  mlp_free(&init);
  teacher_free(&teacher);
  free(X), free(T), free(Xe), free(Te), free(Z), free(At);
  return 0;
}
