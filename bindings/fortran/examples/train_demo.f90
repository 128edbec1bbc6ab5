! SPDX-License-Identifier: MIT
!
! train_demo.f90 -- train a two-layer MLP from Fortran with libdion (host backend).
!
! A tanh MLP "student" (32 -> 64 -> 16, with biases) learns a fixed random "teacher" MLP of the same form
! from fresh Gaussian inputs every step (minibatch 128), mean-squared error. Everything is column-major
! Fortran: a batch is X(n_in, batch), a layer's weight is W(fan_out, fan_in) as in torch.nn.Linear, and
! libdion updates the arrays in place through descriptors made by dion_tensor_2d / dion_tensor_1d (no copies).
!
! Optimizer: one handle, two groups -- Muon (default) or Dion for W1 and W2, AdamW for the biases -- with a
! constant learning rate and a linear decay to 0 over the last 30% of the steps (dion_group_set_hparam).
! The held-out loss (teacher outputs have unit variance: 1.0 is "predicts nothing") is printed every 50
! steps; the program exits with status 1 unless the final loss is below 25% of the initial one.
!
! Build and run (bindings/fortran/ci.sh does the same):
!   gfortran -std=f2008 -O2 bindings/fortran/dion.f90 bindings/fortran/examples/train_demo.f90 \
!            -Lbuild -ldion -Wl,-rpath,$PWD/build -o train_demo
!   ./train_demo [muon|dion] [steps]
program train_demo
  use, intrinsic :: iso_c_binding
  use dion
  implicit none

  integer, parameter :: n_in = 32, n_hid = 64, n_out = 16, batch = 128, n_eval = 1024, every = 50
  real(c_double), parameter :: lr_matrix = 0.02_c_double, lr_bias = 3e-3_c_double, decay_fraction = 0.3_c_double

  ! Student parameters and gradients: TARGET because libdion keeps their addresses and updates them in place.
  real(c_float), target :: w1(n_hid, n_in), b1(n_hid), w2(n_out, n_hid), b2(n_out)
  real(c_float), target :: gw1(n_hid, n_in), gb1(n_hid), gw2(n_out, n_hid), gb2(n_out)
  ! Teacher and data.
  real(c_float) :: tw1(n_hid, n_in), tb1(n_hid), tw2(n_out, n_hid), tb2(n_out)
  real(c_float) :: x(n_in, batch), y(n_out, batch), xe(n_in, n_eval), ye(n_out, n_eval)

  type(c_ptr) :: opt
  type(dion_options_t) :: options
  type(dion_group_options_t) :: gmat, gvec
  type(dion_tensor_t) :: mats(2), vecs(2)
  integer(c_int32_t) :: g_mat, g_vec
  integer :: steps, step, decay_start, nargs
  real(c_double) :: scale
  real(c_float) :: loss0, loss
  character(len=16) :: arg, algo_name
  integer(c_int32_t) :: algo

  ! Command line: [muon|dion] [steps]
  algo = DION_ALGO_MUON
  algo_name = 'muon'
  steps = 600
  nargs = command_argument_count()
  if (nargs >= 1) then
    call get_command_argument(1, arg)
    select case (trim(arg))
    case ('muon')
    case ('dion')
      algo = DION_ALGO_DION
      algo_name = 'dion'
    case default
      write (*, '(a)') 'usage: train_demo [muon|dion] [steps]'
      stop 2
    end select
  end if
  if (nargs >= 2) then
    call get_command_argument(2, arg)
    read (arg, *) steps
  end if

  call seed_rng(20240611)
  call make_teacher()
  call sample(xe, ye)

  ! Student initialisation (torch.nn.Linear-like scale).
  call fill_normal(w1, 1.0 / sqrt(real(n_in)))
  call fill_normal(w2, 1.0 / sqrt(real(n_hid)))
  b1 = 0
  b2 = 0
  gw1 = 0
  gb1 = 0
  gw2 = 0
  gb2 = 0

  ! The optimizer: defaults (host backend), then one group per kind of parameter.
  call check(dion_options_init(options), c_null_ptr, 'dion_options_init')
  call check(dion_create(opt, options), c_null_ptr, 'dion_create')

  call check(dion_group_options_init(gmat, algo), opt, 'dion_group_options_init')
  gmat%lr = lr_matrix
  gmat%weight_decay = 0
  if (algo == DION_ALGO_DION) gmat%rank_fraction = 0.5_c_double
  call check(dion_tensor_2d(mats(1), w1, gw1), opt, 'dion_tensor_2d(w1)')
  call check(dion_tensor_2d(mats(2), w2, gw2), opt, 'dion_tensor_2d(w2)')
  call check(dion_add_tensors(opt, gmat, mats, g_mat, names=['w1', 'w2']), opt, 'dion_add_tensors(matrices)')

  call check(dion_group_options_init(gvec, DION_ALGO_ADAMW), opt, 'dion_group_options_init')
  gvec%lr = lr_bias
  gvec%weight_decay = 0
  call check(dion_tensor_1d(vecs(1), b1, gb1), opt, 'dion_tensor_1d(b1)')
  call check(dion_tensor_1d(vecs(2), b2, gb2), opt, 'dion_tensor_1d(b2)')
  call check(dion_add_tensors(opt, gvec, vecs, g_vec, names=['b1', 'b2']), opt, 'dion_add_tensors(biases)')

  loss0 = eval_loss()
  write (*, '(a,a,a,i0,a)') 'train_demo: ', trim(algo_name), ' for W1, W2 + AdamW for biases, ', steps, ' steps'
  write (*, '(a8,a14)') 'step', 'eval loss'
  write (*, '(i8,f14.6)') 0, loss0

  decay_start = int((1 - decay_fraction) * steps)
  do step = 1, steps
    ! Learning-rate schedule: constant, then linear decay to 0.
    if (step > decay_start) then
      scale = real(steps - step + 1, c_double) / real(steps - decay_start, c_double)
      call check(dion_group_set_hparam(opt, g_mat, DION_HPARAM_LR, lr_matrix * scale), opt, 'set lr')
      call check(dion_group_set_hparam(opt, g_vec, DION_HPARAM_LR, lr_bias * scale), opt, 'set lr')
    end if
    call sample(x, y)
    loss = forward_backward(x, y)
    call check(dion_step(opt, c_null_ptr), opt, 'dion_step')
    if (mod(step, every) == 0 .or. step == steps) write (*, '(i8,f14.6)') step, eval_loss()
  end do

  loss = eval_loss()
  call check(dion_destroy(opt), c_null_ptr, 'dion_destroy')
  write (*, '(a,f10.6,a,f10.6,a,f6.3)') 'initial loss ', loss0, ', final loss ', loss, ', ratio ', loss / loss0
  if (.not. (loss < 0.25 * loss0)) then
    write (*, '(a)') 'train_demo: FAILED, the loss did not fall below 25% of its initial value'
    stop 1
  end if
  write (*, '(a)') 'train_demo: OK'

contains

  ! Examples may stop on error (a library may not).
  subroutine check(status, handle, what)
    integer(c_int32_t), intent(in) :: status
    type(c_ptr), intent(in) :: handle
    character(len=*), intent(in) :: what
    if (status /= DION_SUCCESS) then
      write (*, '(a,a,a)') what, ' failed: ', dion_status_message(status)
      write (*, '(2x,a)') dion_error_message(handle)
      stop 1
    end if
  end subroutine check

  subroutine seed_rng(s)
    integer, intent(in) :: s
    integer :: k, i
    integer, allocatable :: seed(:)
    call random_seed(size=k)
    allocate (seed(k))
    seed = [(s + 7919 * i, i = 1, k)]
    call random_seed(put=seed)
  end subroutine seed_rng

  subroutine fill_normal(a, std)
    real(c_float), intent(out) :: a(:, :)
    real, intent(in) :: std
    real(c_float) :: u(size(a, 1), size(a, 2)), v(size(a, 1), size(a, 2))
    call random_number(u)
    call random_number(v)
    a = std * sqrt(-2.0 * log(1.0 - u)) * cos(6.2831853 * v)
  end subroutine fill_normal

  subroutine make_teacher()
    real(c_float), allocatable :: xs(:, :), ys(:, :)
    allocate (xs(n_in, 4096), ys(n_out, 4096))
    call fill_normal(tw1, 2.0 / sqrt(real(n_in)))
    call fill_normal(tw2, 1.0 / sqrt(real(n_hid)))
    call random_number(tb1)
    call random_number(tb2)
    tb1 = tb1 - 0.5
    tb2 = 0
    ! Normalise the teacher's outputs to unit variance.
    call fill_normal(xs, 1.0)
    call teacher(xs, ys)
    tw2 = tw2 / sqrt(sum(ys**2) / size(ys))
  end subroutine make_teacher

  subroutine teacher(xb, yb)
    real(c_float), intent(in) :: xb(:, :)
    real(c_float), intent(out) :: yb(:, :)
    real(c_float), allocatable :: h(:, :)
    integer :: j
    allocate (h(n_hid, size(xb, 2)))
    h = matmul(tw1, xb)
    do j = 1, size(xb, 2)
      h(:, j) = tanh(h(:, j) + tb1)
    end do
    yb = matmul(tw2, h)
    do j = 1, size(xb, 2)
      yb(:, j) = yb(:, j) + tb2
    end do
  end subroutine teacher

  subroutine sample(xb, yb)
    real(c_float), intent(out) :: xb(:, :), yb(:, :)
    call fill_normal(xb, 1.0)
    call teacher(xb, yb)
  end subroutine sample

  ! Loss and gradients (into gw1, gb1, gw2, gb2 in place) for one minibatch.
  function forward_backward(xb, yb) result(l)
    real(c_float), intent(in) :: xb(:, :), yb(:, :)
    real(c_float) :: l
    real(c_float) :: h(n_hid, size(xb, 2)), dy(n_out, size(xb, 2)), dz(n_hid, size(xb, 2))
    integer :: nb
    nb = size(xb, 2)
    h = tanh(matmul(w1, xb) + spread(b1, 2, nb))
    dy = matmul(w2, h) + spread(b2, 2, nb) - yb
    l = sum(dy**2) / (n_out * nb)
    dy = 2 * dy / (n_out * nb)
    gw2 = matmul(dy, transpose(h))
    gb2 = sum(dy, 2)
    dz = matmul(transpose(w2), dy) * (1 - h**2)
    gw1 = matmul(dz, transpose(xb))
    gb1 = sum(dz, 2)
  end function forward_backward

  function eval_loss() result(l)
    real(c_float) :: l
    real(c_float), allocatable :: h(:, :), d(:, :)
    integer :: j
    allocate (h(n_hid, n_eval), d(n_out, n_eval))
    h = matmul(w1, xe)
    do j = 1, n_eval
      h(:, j) = tanh(h(:, j) + b1)
    end do
    d = matmul(w2, h)
    do j = 1, n_eval
      d(:, j) = d(:, j) + b2 - ye(:, j)
    end do
    l = sum(d**2) / size(d)
  end function eval_loss
end program train_demo
