! SPDX-License-Identifier: MIT
!
! test_dion.f90 -- tests of the Fortran bindings against libdion's host backend.
!
!   1. struct layouts: c_sizeof of every bind(C) type against dion_*_sizeof(), and every field of the *_init
!      defaults read back through the Fortran types (a shifted field shows up as a wrong default);
!   2. error paths: negative lr -> DION_ERROR_INVALID_ARGUMENT with a message naming "lr" (at dion_add_group and
!      at dion_group_set_hparam), a bad group index -> INVALID_USAGE, a failed dion_create -> thread message,
!      tensor names reaching the messages, strided arrays refused by the descriptor helpers;
!   3. column-major equivalence: for every algorithm and a tall and a wide shape, a Fortran matrix X(m, n)
!      stepped through dion_tensor_2d (DION_LAYOUT_COL_MAJOR, no copy) must equal a row-major run of the raw
!      interface on a transposed copy (a second optimizer), parameters and momentum, after every step;
!   4. the rest of the surface on the host backend: counts, hparams, step counters, state info/read/write,
!      rebind, non-finite skipping, memory and comm counters, communicator calls that need no MPI/NCCL.
!
! Exits with status 1 if any check fails; the last line is "test_dion: N passed, M failed".
program test_dion
  use, intrinsic :: iso_c_binding
  use, intrinsic :: ieee_arithmetic, only: ieee_value, ieee_quiet_nan
  use dion
  implicit none

  integer :: n_pass = 0, n_fail = 0

  write (*, '(a,i0,a,i0)') 'libdion version ', dion_version(), ', bindings built for ', DION_VERSION_CODE
  call expect(dion_version() / 10000 == DION_VERSION_MAJOR, 'major version of the loaded library')

  call test_layouts()
  call test_errors()
  call test_col_major_equivalence()
  call test_surface()

  write (*, '(a,i0,a,i0,a)') 'test_dion: ', n_pass, ' passed, ', n_fail, ' failed'
  if (n_fail > 0) error stop 1

contains

  subroutine expect(cond, what)
    logical, intent(in) :: cond
    character(len=*), intent(in) :: what
    if (cond) then
      n_pass = n_pass + 1
    else
      n_fail = n_fail + 1
      write (*, '(a,a)') 'FAILED: ', what
    end if
  end subroutine expect

  subroutine expect_status(got, want, what, opt)
    integer(c_int32_t), intent(in) :: got, want
    character(len=*), intent(in) :: what
    type(c_ptr), intent(in) :: opt
    if (got /= want) then
      write (*, '(a,a,a,i0,a,i0,a,a)') '  ', what, ': status ', got, ' (expected ', want, ') ', dion_error_message(opt)
    end if
    call expect(got == want, what)
  end subroutine expect_status

  subroutine fill_normal(x)
    real(c_float), intent(out) :: x(:, :)
    real(c_float) :: u(size(x, 1), size(x, 2)), v(size(x, 1), size(x, 2))
    call random_number(u)
    call random_number(v)
    x = sqrt(-2.0_c_float * log(1.0_c_float - u)) * cos(6.2831853_c_float * v)
  end subroutine fill_normal

  subroutine seed_rng(s)
    integer, intent(in) :: s
    integer :: k, i
    integer, allocatable :: seed(:)
    call random_seed(size=k)
    allocate (seed(k))
    seed = [(s + 7919 * i, i = 1, k)]
    call random_seed(put=seed)
  end subroutine seed_rng

  ! ---------------------------------------------------------------------------------------------------------------
  subroutine test_layouts()
    type(dion_options_t) :: o
    type(dion_tensor_t) :: t
    type(dion_group_options_t) :: g
    type(dion_state_info_t) :: si
    type(dion_nccl_unique_id_t) :: id

    write (*, '(a)') '[layouts]'
    write (*, '(a,4(i0,1x))') '  c_sizeof options/tensor/group_options/state_info: ', c_sizeof(o), c_sizeof(t), &
      c_sizeof(g), c_sizeof(si)
    call expect(c_sizeof(o) == dion_options_sizeof(), 'sizeof(dion_options_t) == dion_options_sizeof()')
    call expect(c_sizeof(t) == dion_tensor_sizeof(), 'sizeof(dion_tensor_t) == dion_tensor_sizeof()')
    call expect(c_sizeof(g) == dion_group_options_sizeof(), 'sizeof(dion_group_options_t) == dion_group_options_sizeof()')
    call expect(c_sizeof(id) == DION_NCCL_UNIQUE_ID_BYTES, 'sizeof(dion_nccl_unique_id_t) == 128')
    ! dion.h has no dion_state_info_sizeof(); the x86-64/aarch64 LP64 size, checked again by reading an info below.
    call expect(c_sizeof(si) == 144, 'sizeof(dion_state_info_t) == 144 (LP64)')

    call expect(dion_options_init(o) == DION_SUCCESS, 'dion_options_init')
    call expect(o%struct_size == dion_options_sizeof() .and. o%abi_version == DION_ABI_VERSION, 'options: size, abi')
    call expect(o%backend == DION_BACKEND_HOST .and. o%device == 0, 'options: backend, device')
    call expect(o%replicate_grad_sync == 1 .and. o%skip_nonfinite == 1 .and. o%reserved0 == 0, 'options: flags')
    call expect(o%seed == 0, 'options: seed')
    call expect(.not. (c_associated(o%replicate_comm) .or. c_associated(o%outer_comm) .or. c_associated(o%inner_comm)), &
                'options: communicators NULL')

    call expect(dion_tensor_init(t) == DION_SUCCESS, 'dion_tensor_init')
    call expect(t%struct_size == dion_tensor_sizeof(), 'tensor: struct_size')
    call expect(.not. (c_associated(t%name) .or. c_associated(t%param) .or. c_associated(t%grad)), 'tensor: NULL pointers')
    call expect(t%grad_dtype == DION_DTYPE_UNSET .and. t%layout == DION_LAYOUT_ROW_MAJOR, 'tensor: grad_dtype, layout')
    call expect(t%outer_shard_dim == -1 .and. t%inner_shard_dim == -1, 'tensor: shard dims -1')

    call expect(dion_group_options_init(g, DION_ALGO_NORMUON) == DION_SUCCESS, 'dion_group_options_init')
    call expect(g%struct_size == dion_group_options_sizeof() .and. g%abi_version == DION_ABI_VERSION, 'group: size, abi')
    call expect(g%algorithm == DION_ALGO_NORMUON, 'group: algorithm')
    call expect(g%lr == 0.01_c_double .and. g%weight_decay == 0.01_c_double .and. g%mu == 0.95_c_double, &
                'group: lr, weight_decay, mu')
    call expect(g%beta1 == 0.9_c_double .and. g%beta2 == 0.95_c_double .and. g%epsilon == 1e-8_c_double, &
                'group: beta1, beta2, epsilon')
    call expect(g%rank_fraction == 1.0_c_double .and. g%rank_multiple_of == 1 .and. g%power_iters == 1, &
                'group: rank_fraction, rank_multiple_of, power_iters')
    call expect(g%qr_method == DION_QR_RCQR .and. g%cqr_warmup_steps == 150 .and. g%oversample == 1.25_c_double, &
                'group: qr_method, cqr_warmup_steps, oversample')
    call expect(g%orthogonalizer == DION_ORTHO_POLAR_EXPRESS .and. g%ortho_steps == 5 .and. g%nesterov == 0, &
                'group: orthogonalizer, ortho_steps, nesterov')
    call expect(g%adjust_lr == DION_ADJUST_LR_SPECTRAL_NORM .and. g%cautious_wd == 0, 'group: adjust_lr, cautious_wd')
    call expect(g%fraction == 0.25_c_double .and. g%ef_decay == 0.95_c_double, 'group: fraction, ef_decay')
    call expect(g%selection_scope == DION_SELECTION_LOCAL .and. g%muon_beta2 == 0.95_c_double .and. g%flatten == 0, &
                'group: selection_scope, muon_beta2, flatten')
    call expect(g%momentum_dtype == DION_DTYPE_UNSET .and. g%q_dtype == DION_DTYPE_UNSET .and. &
                g%variance_dtype == DION_DTYPE_UNSET .and. g%matmul_precision == DION_MATMUL_FP32, &
                'group: dtypes UNSET, matmul_precision FP32')
  end subroutine test_layouts

  ! ---------------------------------------------------------------------------------------------------------------
  subroutine test_errors()
    type(dion_options_t) :: o
    type(dion_group_options_t) :: g
    type(dion_tensor_t) :: t(2)
    type(c_ptr) :: opt, bad
    integer(c_int32_t) :: st, gi
    real(c_float), target :: w(8, 6), gw(8, 6), b(8), gb(8), big(8, 12)
    character(len=:), allocatable :: msg

    write (*, '(a)') '[errors]'
    call expect(index(dion_status_message(DION_ERROR_INVALID_ARGUMENT), 'invalid argument') > 0, &
                'dion_status_string(INVALID_ARGUMENT)')
    call expect(len(dion_status_message(12345_c_int32_t)) > 0, 'dion_status_string(unknown) is text')

    ! A failing dion_create: NULL handle, message on the thread.
    st = dion_options_init(o)
    o%backend = 7
    st = dion_create(bad, o)
    call expect(st == DION_ERROR_INVALID_ARGUMENT, 'dion_create(backend = 7) -> INVALID_ARGUMENT')
    call expect(.not. c_associated(bad), 'dion_create failure leaves the handle NULL')
    msg = dion_error_message(c_null_ptr)
    write (*, '(a,a)') '  thread error: ', msg
    call expect(len(msg) > 0, 'dion_last_error(NULL) holds the dion_create message')

    st = dion_options_init(o)
    call expect_status(dion_create(opt, o), DION_SUCCESS, 'dion_create', c_null_ptr)
    w = 1
    gw = 1
    b = 0
    gb = 1
    call expect(dion_error_message(opt) == '', 'no error message before a failure')

    ! Negative lr at dion_add_group.
    st = dion_group_options_init(g, DION_ALGO_MUON)
    g%lr = -1
    call expect_status(dion_tensor_2d(t(1), w, gw), DION_SUCCESS, 'dion_tensor_2d', opt)
    st = dion_add_tensors(opt, g, t(1:1), gi)
    msg = dion_error_message(opt)
    write (*, '(a,a)') '  negative lr: ', msg
    call expect(st == DION_ERROR_INVALID_ARGUMENT, 'negative lr -> DION_ERROR_INVALID_ARGUMENT')
    call expect(index(msg, 'lr') > 0, 'negative lr message names "lr"')
    call expect(gi == -1, 'failed dion_add_tensors leaves group_index -1')
    st = dion_group_count(opt, gi)
    call expect(gi == 0, 'a failed dion_add_group adds nothing')

    ! Names reach the messages: Muon on a vector is refused, naming it.
    st = dion_group_options_init(g, DION_ALGO_MUON)
    call expect_status(dion_tensor_1d(t(2), b, gb), DION_SUCCESS, 'dion_tensor_1d', opt)
    st = dion_add_tensors(opt, g, t, gi, names=[character(len=8) :: 'W1', 'bias_one'])
    msg = dion_error_message(opt)
    write (*, '(a,a)') '  Muon on a vector: ', msg
    call expect(st == DION_ERROR_INVALID_ARGUMENT, 'Muon on a 1-D tensor -> INVALID_ARGUMENT')
    call expect(index(msg, 'bias_one') > 0, 'the message names the tensor given by name')

    ! A valid group, then negative lr through dion_group_set_hparam.
    call expect_status(dion_add_tensors(opt, g, t(1:1), gi, names=['W1']), DION_SUCCESS, 'dion_add_tensors', opt)
    call expect(gi == 0, 'first group index is 0')
    st = dion_group_set_hparam(opt, gi, DION_HPARAM_LR, -0.5_c_double)
    msg = dion_error_message(opt)
    write (*, '(a,a)') '  set_hparam(lr = -0.5): ', msg
    call expect(st == DION_ERROR_INVALID_ARGUMENT, 'set_hparam(negative lr) -> INVALID_ARGUMENT')
    call expect(index(msg, 'lr') > 0, 'set_hparam message names "lr"')
    st = dion_group_set_hparam(opt, 5_c_int32_t, DION_HPARAM_LR, 0.1_c_double)
    call expect(st == DION_ERROR_INVALID_USAGE, 'set_hparam(bad group) -> INVALID_USAGE')

    ! The descriptor helpers refuse strided arrays (instead of letting the compiler pass a temporary copy).
    call expect(dion_tensor_2d(t(1), big(:, 1:12:2)) == DION_ERROR_INVALID_ARGUMENT, 'strided column section refused')
    call expect(dion_tensor_2d(t(1), big(1:8:2, :)) == DION_ERROR_INVALID_ARGUMENT, 'strided row section refused')
    call expect(dion_tensor_2d(t(1), big(:, 3:8)) == DION_SUCCESS, 'contiguous column block accepted')
    call expect(c_associated(t(1)%param, c_loc(big(1, 3))), 'descriptor points at the array itself (no copy)')
    call expect(dion_tensor_2d(t(1), w, gw(1:4, :)) == DION_ERROR_INVALID_ARGUMENT, 'grad of another shape refused')
    call expect(dion_tensor_1d(t(2), b(8:1:-1)) == DION_ERROR_INVALID_ARGUMENT, 'reversed vector refused')

    call expect_status(dion_destroy(opt), DION_SUCCESS, 'dion_destroy', c_null_ptr)
    call expect_status(dion_destroy(c_null_ptr), DION_SUCCESS, 'dion_destroy(NULL)', c_null_ptr)
  end subroutine test_errors

  ! ---------------------------------------------------------------------------------------------------------------
  subroutine test_col_major_equivalence()
    integer(c_int32_t), parameter :: algos(7) = [DION_ALGO_DION, DION_ALGO_DION2, DION_ALGO_MUON, DION_ALGO_NORMUON, &
                                                 DION_ALGO_NORDION2, DION_ALGO_ADAMW, DION_ALGO_LION]
    character(len=8), parameter :: names(7) = [character(len=8) :: 'Dion', 'Dion2', 'Muon', 'NorMuon', 'NorDion2', &
                                               'AdamW', 'Lion']
    integer, parameter :: shapes(2, 2) = reshape([24, 40, 40, 24], [2, 2])
    integer :: a, s

    write (*, '(a)') '[column-major == row-major on the transpose]'
    do a = 1, size(algos)
      do s = 1, 2
        call compare_layouts(algos(a), trim(names(a)), shapes(1, s), shapes(2, s))
      end do
    end do
  end subroutine test_col_major_equivalence

  subroutine compare_layouts(algo, name, m, n)
    integer(c_int32_t), intent(in) :: algo
    character(len=*), intent(in) :: name
    integer, intent(in) :: m, n
    integer, parameter :: steps = 5
    real(c_float), allocatable, target :: x(:, :), g(:, :), xt(:, :), gt(:, :), mom(:, :), momt(:, :)
    type(dion_options_t) :: o
    type(dion_group_options_t) :: go
    type(dion_tensor_t) :: tf(1), tc(1)
    type(dion_state_info_t) :: info
    type(c_ptr) :: opt_f, opt_c
    integer(c_int32_t) :: st, gi, im_f, im_c
    real(c_float) :: err, err_m, scale
    integer :: k
    character(len=64) :: label

    write (label, '(a,1x,i0,a,i0)') name, m, 'x', n
    allocate (x(m, n), g(m, n), xt(n, m), gt(n, m), mom(m, n), momt(n, m))
    call seed_rng(1000 * m + n + 17 * algo)
    call fill_normal(x)
    x = x / sqrt(real(n, c_float))
    xt = transpose(x)

    st = dion_options_init(o)
    o%seed = 42
    st = dion_group_options_init(go, algo)
    go%lr = 0.02_c_double
    go%weight_decay = 0.1_c_double
    if (algo == DION_ALGO_DION) go%rank_fraction = 0.5_c_double

    ! A: the Fortran array, column-major, through the wrapper.
    call expect_status(dion_create(opt_f, o), DION_SUCCESS, trim(label) // ': create (Fortran)', c_null_ptr)
    call expect_status(dion_tensor_2d(tf(1), x, g), DION_SUCCESS, trim(label) // ': dion_tensor_2d', opt_f)
    call expect_status(dion_add_tensors(opt_f, go, tf, gi, names=['X']), DION_SUCCESS, trim(label) // ': add (Fortran)', opt_f)

    ! B: the raw interface, row-major (m, n): xt(n, m) in Fortran order is X in C order.
    call expect_status(dion_create(opt_c, o), DION_SUCCESS, trim(label) // ': create (C)', c_null_ptr)
    st = dion_tensor_init(tc(1))
    tc(1)%param = c_loc(xt)
    tc(1)%grad = c_loc(gt)
    tc(1)%param_dtype = DION_DTYPE_FP32
    tc(1)%layout = DION_LAYOUT_ROW_MAJOR
    tc(1)%ndim = 2
    tc(1)%shape = [int(m, c_int64_t), int(n, c_int64_t), 0_c_int64_t, 0_c_int64_t]
    call expect_status(dion_add_group(opt_c, go, tc, 1_c_size_t, gi), DION_SUCCESS, trim(label) // ': add (C)', opt_c)

    call expect_status(dion_find_state(opt_f, 0, 'momentum', im_f), DION_SUCCESS, trim(label) // ': find momentum', opt_f)
    call expect_status(dion_find_state(opt_c, 0, 'momentum', im_c), DION_SUCCESS, trim(label) // ': find momentum', opt_c)
    info%struct_size = c_sizeof(info)
    call expect_status(dion_state_info(opt_f, im_f, info), DION_SUCCESS, trim(label) // ': state info', opt_f)
    call expect(dion_c_string(info%name) == 'momentum' .and. info%tensor == 0 .and. info%group == 0 .and. &
                info%layout == DION_LAYOUT_COL_MAJOR .and. info%ndim == 2 .and. info%dtype == DION_DTYPE_FP32 .and. &
                info%global_shape(1) == m .and. info%global_shape(2) == n .and. info%local_bytes == 4 * m * n, &
                trim(label) // ': momentum info (column-major, logical shape)')

    err = 0
    err_m = 0
    do k = 1, steps
      call fill_normal(g)
      gt = transpose(g)
      call expect_status(dion_step(opt_f, c_null_ptr), DION_SUCCESS, trim(label) // ': step (Fortran)', opt_f)
      call expect_status(dion_step(opt_c, c_null_ptr), DION_SUCCESS, trim(label) // ': step (C)', opt_c)
      scale = max(1e-6_c_float, maxval(abs(x)))
      err = max(err, maxval(abs(x - transpose(xt))) / scale)
      st = dion_read_state(opt_f, im_f, mom)
      st = dion_read_state(opt_c, im_c, momt)
      scale = max(1e-6_c_float, maxval(abs(mom)))
      err_m = max(err_m, maxval(abs(mom - transpose(momt))) / scale)
    end do
    write (*, '(2x,a,t24,a,es9.2,a,es9.2)') trim(label), 'max rel. diff: params ', err, ', momentum ', err_m
    call expect(err <= 1e-5, trim(label) // ': column-major params == row-major params on the transpose')
    call expect(err_m <= 1e-5, trim(label) // ': column-major momentum == row-major momentum on the transpose')
    st = dion_destroy(opt_f)
    st = dion_destroy(opt_c)
  end subroutine compare_layouts

  ! ---------------------------------------------------------------------------------------------------------------
  subroutine test_surface()
    integer, parameter :: m = 16, n = 12
    real(c_float), target :: w(m, n), gw(m, n), gw2(m, n), b(m), gb(m), w0(m, n), mom(m, n), mom2(m, n)
    type(dion_options_t) :: o
    type(dion_group_options_t) :: gm, ga
    type(dion_tensor_t) :: tw(1), tb(1)
    type(dion_state_info_t) :: info
    type(c_ptr) :: opt, comm
    type(dion_nccl_unique_id_t) :: uid
    integer(c_int32_t) :: st, g0, g1, cnt, idx, last, astat
    integer(c_int64_t) :: step, skipped, b1, b2
    real(c_double) :: v
    character(len=:), allocatable :: msg

    write (*, '(a)') '[surface]'
    call seed_rng(7)
    call fill_normal(w)
    b = 0
    gb = 0.5
    st = dion_options_init(o)
    call expect_status(dion_create(opt, o), DION_SUCCESS, 'create', c_null_ptr)
    st = dion_group_options_init(gm, DION_ALGO_MUON)
    st = dion_group_options_init(ga, DION_ALGO_ADAMW)
    call expect_status(dion_tensor_2d(tw(1), w, gw), DION_SUCCESS, 'tensor_2d', opt)
    call expect_status(dion_tensor_1d(tb(1), b, gb), DION_SUCCESS, 'tensor_1d', opt)
    call expect_status(dion_add_tensors(opt, gm, tw, g0, names=['W']), DION_SUCCESS, 'add Muon group', opt)
    call expect_status(dion_add_tensors(opt, ga, tb, g1, names=['b']), DION_SUCCESS, 'add AdamW group', opt)
    call expect(g0 == 0 .and. g1 == 1, 'group indices 0, 1')
    st = dion_group_count(opt, cnt)
    call expect(cnt == 2, 'dion_group_count == 2')
    st = dion_tensor_count(opt, cnt)
    call expect(cnt == 2, 'dion_tensor_count == 2')

    call expect_status(dion_group_set_hparam(opt, g1, DION_HPARAM_BETA2, 0.99_c_double), DION_SUCCESS, 'set beta2', opt)
    call expect_status(dion_group_get_hparam(opt, g1, DION_HPARAM_BETA2, v), DION_SUCCESS, 'get beta2', opt)
    call expect(v == 0.99_c_double, 'hparam round trip')

    call fill_normal(gw)
    call expect_status(dion_step(opt, c_null_ptr), DION_SUCCESS, 'step 1', opt)
    call expect_status(dion_group_get_step(opt, g0, step), DION_SUCCESS, 'get_step', opt)
    call expect(step == 1, 'step counter 1 after one step')
    call expect(all(b < 0), 'AdamW moved the bias against a positive gradient')

    ! Skipping a non-finite gradient changes nothing.
    w0 = w
    gw(3, 4) = ieee_value(gw(3, 4), ieee_quiet_nan)
    call expect_status(dion_step(opt, c_null_ptr), DION_SUCCESS, 'step with NaN', opt)
    call expect_status(dion_get_skipped_steps(opt, skipped, last, c_null_ptr), DION_SUCCESS, 'get_skipped_steps', opt)
    call expect(skipped == 1 .and. last == 1, 'NaN step skipped and counted')
    call expect(all(w == w0), 'skipped step left the matrix unchanged')
    st = dion_group_get_step(opt, g0, step)
    call expect(step == 1, 'skipped step did not advance the counter')

    ! Rebind to a fresh gradient buffer, step, set_step.
    call fill_normal(gw2)
    call expect_status(dion_rebind_2d(opt, 0, w, gw2), DION_SUCCESS, 'rebind_2d', opt)
    call expect_status(dion_step(opt, c_null_ptr), DION_SUCCESS, 'step after rebind', opt)
    call expect(any(w /= w0), 'step after rebind moved the matrix')
    st = dion_get_skipped_steps(opt, skipped, last, c_null_ptr)
    call expect(last == 0, 'last step not skipped')
    call expect_status(dion_group_set_step(opt, g1, 100_c_int64_t), DION_SUCCESS, 'set_step', opt)
    st = dion_group_get_step(opt, g1, step)
    call expect(step == 100, 'set_step round trip')
    call expect(dion_rebind_1d(opt, 1, b) == DION_SUCCESS, 'rebind_1d without a gradient')

    ! States: enumerate, read, write back modified, read again.
    call expect_status(dion_state_count(opt, cnt), DION_SUCCESS, 'state_count', opt)
    call expect(cnt >= 3, 'at least 3 states (momentum of W; momentum and variance of b)')
    info%struct_size = c_sizeof(info)
    call expect_status(dion_state_info(opt, cnt - 1, info), DION_SUCCESS, 'state_info(last)', opt)
    write (*, '(a,a,a,i0)') '  last state: ', dion_c_string(info%name), ' of tensor ', info%tensor
    call expect(info%tensor == 1 .and. info%group == 1 .and. info%ndim == 1 .and. info%local_shape(1) == m .and. &
                info%local_bytes == 4 * m, 'state_info of the bias state')
    call expect_status(dion_find_state(opt, 1, 'variance', idx), DION_SUCCESS, 'find variance', opt)
    st = dion_find_state(opt, 1, 'Q', idx)
    msg = dion_error_message(opt)
    call expect(st == DION_ERROR_INVALID_ARGUMENT .and. index(msg, 'Q') > 0, 'find a missing state -> INVALID_ARGUMENT')
    call expect_status(dion_find_state(opt, 0, 'momentum', idx), DION_SUCCESS, 'find momentum', opt)
    call expect_status(dion_read_state(opt, idx, mom), DION_SUCCESS, 'read momentum', opt)
    call expect(any(mom /= 0), 'momentum is not zero after steps')
    mom(1, 2) = 123.0
    call expect_status(dion_write_state(opt, idx, mom), DION_SUCCESS, 'write momentum', opt)
    call expect_status(dion_read_state(opt, idx, mom2), DION_SUCCESS, 'read momentum back', opt)
    call expect(all(mom2 == mom), 'state write/read round trip (column-major)')
    st = dion_read_state(opt, idx, mom(1:4, 1:2))
    call expect(st /= DION_SUCCESS, 'short state buffer refused')

    call expect_status(dion_get_memory_usage(opt, b1, b2), DION_SUCCESS, 'get_memory_usage', opt)
    call expect(b1 >= 4 * (m * n + 2 * m), 'state bytes cover momentum and AdamW moments')
    call expect_status(dion_get_comm_bytes(opt, DION_MESH_REPLICATE, b1, b2), DION_SUCCESS, 'get_comm_bytes', opt)
    call expect(b1 == 0 .and. b2 == 0, 'no communication without meshes')
    call expect_status(dion_get_async_error(opt, astat), DION_SUCCESS, 'get_async_error', opt)
    call expect(astat == DION_SUCCESS, 'no async error')
    call expect_status(dion_sync_for_checkpoint(opt, c_null_ptr), DION_SUCCESS, 'sync_for_checkpoint', opt)

    ! Communicators: NULL is "absent"; destroying NULL is a no-op.
    call expect(dion_comm_destroy(c_null_ptr) == DION_SUCCESS, 'comm_destroy(NULL)')
    ! (dion_comm_from_mpi_fint is not called: in an MPI build it needs MPI_Init first, which this test does not do.)
    comm = c_null_ptr
    call expect(dion_comm_size(comm, cnt) == DION_ERROR_INVALID_ARGUMENT, 'comm_size(NULL) -> INVALID_ARGUMENT')
    st = dion_nccl_get_unique_id(uid)
    call expect(st == DION_SUCCESS .or. st == DION_ERROR_NOT_SUPPORTED, 'nccl_get_unique_id: SUCCESS or NOT_SUPPORTED')

    call expect_status(dion_destroy(opt), DION_SUCCESS, 'destroy', c_null_ptr)
  end subroutine test_surface
end program test_dion
