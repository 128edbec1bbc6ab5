! Uses only the installed Fortran module: a Muon group over a 4 x 3 matrix and an AdamW group over a vector,
! one step, and a check that every parameter changed. Prints "fortran consumer OK" and exits 0 on success.
program fortran_consumer
  use, intrinsic :: iso_c_binding
  use dion
  implicit none
  real(c_float), target :: w(4, 3), gw(4, 3), b(5), gb(5)
  real(c_float) :: w0(4, 3), b0(5)
  type(c_ptr) :: opt = c_null_ptr
  type(dion_options_t) :: o
  type(dion_group_options_t) :: gm, gv
  type(dion_tensor_t) :: tw(1), tb(1)
  integer(c_int32_t) :: g_w, g_b
  integer :: i, j

  do j = 1, 3
    do i = 1, 4
      w(i, j) = 0.1 * (i + 4 * (j - 1))
      gw(i, j) = real(mod(7 * (i + 4 * j), 5) - 2, c_float)
    end do
  end do
  do i = 1, 5
    b(i) = 0.5 * i
    gb(i) = real(i - 3, c_float) + 0.25
  end do
  w0 = w
  b0 = b

  call check(dion_options_init(o), 'dion_options_init')
  call check(dion_create(opt, o), 'dion_create')
  call check(dion_group_options_init(gm, DION_ALGO_MUON), 'dion_group_options_init(muon)')
  gm%lr = 0.02d0
  call check(dion_tensor_2d(tw(1), w, gw), 'dion_tensor_2d')
  call check(dion_add_tensors(opt, gm, tw, g_w, names=['w']), 'dion_add_tensors(muon)')
  call check(dion_group_options_init(gv, DION_ALGO_ADAMW), 'dion_group_options_init(adamw)')
  call check(dion_tensor_1d(tb(1), b, gb), 'dion_tensor_1d')
  call check(dion_add_tensors(opt, gv, tb, g_b, names=['b']), 'dion_add_tensors(adamw)')
  call check(dion_step(opt, c_null_ptr), 'dion_step')
  call check(dion_destroy(opt), 'dion_destroy')

  if (any(w == w0) .or. any(b == b0)) then
    print '(a)', 'fortran consumer: a parameter did not change'
    error stop 1
  end if
  print '(a,i0,a,es12.5,a,es12.5)', 'fortran consumer OK: libdion ', dion_version(), ', w(1,1) ', w(1, 1), &
    ', b(1) ', b(1)

contains

  subroutine check(status, what)
    integer(c_int32_t), intent(in) :: status
    character(len=*), intent(in) :: what
    if (status /= DION_SUCCESS) then
      print '(a,a,a,a)', 'fortran consumer: ', what, ' failed: ', dion_status_message(status)
      if (c_associated(opt)) print '(a)', dion_error_message(opt)
      error stop 1
    end if
  end subroutine check
end program fortran_consumer
