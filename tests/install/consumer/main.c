/* Uses only the installed dion.h: one Muon step on a 4 x 3 matrix. */
#include <dion.h>
#include <stdio.h>

int main(void) {
  float x[12], g[12];
  int i;
  dion_optimizer_t opt = NULL;
  dion_group_options_t go;
  dion_tensor_t t;
  for (i = 0; i < 12; ++i) {
    x[i] = 0.1f * (float)i;
    g[i] = (float)((i * 7) % 5) - 2.0f;
  }
  if (dion_create(&opt, NULL) != DION_SUCCESS) return 1;
  dion_group_options_init(&go, DION_ALGO_MUON);
  dion_tensor_init(&t);
  t.param = x;
  t.grad = g;
  t.ndim = 2;
  t.shape[0] = 4;
  t.shape[1] = 3;
  if (dion_add_group(opt, &go, &t, 1, NULL) != DION_SUCCESS || dion_step(opt, NULL) != DION_SUCCESS) {
    fprintf(stderr, "consumer: %s\n", dion_last_error(opt));
    return 1;
  }
  dion_destroy(opt);
  printf("consumer ok: libdion %d, x[0] = %g\n", (int)dion_version(), (double)x[0]);
  return 0;
}
