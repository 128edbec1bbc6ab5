/* The smallest libdion program: create, add a Muon group, step, read the state. */
#include <dion.h>
#include <stdio.h>

#define CHECK(call)                                                         \
  do {                                                                      \
    if ((call) != DION_SUCCESS) {                                           \
      fprintf(stderr, "%s failed: %s\n", #call, dion_last_error(opt));      \
      return 1;                                                             \
    }                                                                       \
  } while (0)

int main(void) {
  enum { M = 4, N = 3 };
  float w[M * N], g[M * N], momentum[M * N];
  dion_optimizer_t opt = NULL;
  dion_group_options_t muon;
  dion_tensor_t t;
  int32_t group = -1, state = -1;
  int i;
  for (i = 0; i < M * N; ++i) {
    w[i] = 0.1f * (float)(i % 5);
    g[i] = (float)((i * 7) % 5) - 2.0f;
  }
  CHECK(dion_create(&opt, NULL));
  CHECK(dion_group_options_init(&muon, DION_ALGO_MUON));
  muon.lr = 0.02;
  CHECK(dion_tensor_init(&t));
  t.name = "w";
  t.param = w;
  t.grad = g;
  t.ndim = 2;
  t.shape[0] = M;
  t.shape[1] = N;
  CHECK(dion_add_group(opt, &muon, &t, 1, &group));
  CHECK(dion_step(opt, NULL));
  CHECK(dion_state_find(opt, 0, "momentum", &state));
  CHECK(dion_state_read(opt, state, momentum, sizeof(momentum), NULL));
  printf("libdion %d: w[0] = %.6f, momentum[0] = %.1f (= g[0] after one step)\n", (int)dion_version(),
         (double)w[0], (double)momentum[0]);
  dion_destroy(opt);
  return momentum[0] == g[0] ? 0 : 1;
}
