! SPDX-License-Identifier: MIT
!
! dion.f90 -- Fortran 2008 bindings of libdion (include/dion.h).
!
! Two modules:
!   dion_enums  every constant of dion.h as an integer(c_int32_t) parameter (plus the version macros);
!   dion        the option/descriptor structs as `type, bind(C)`, one bind(C) interface per function of dion.h
!               in header order (named exactly as in C), and a few Fortran-friendly module procedures
!               (descriptors from Fortran arrays, error messages as Fortran strings, state I/O).
!
! Every C type is mapped by the table in README.md (after FFTW's genf03.pl); nothing outside it is bound.
! `use dion` also gives dion_enums and iso_c_binding's kinds are the caller's to import:
!
!     use, intrinsic :: iso_c_binding
!     use dion
!
! Arrays that the optimizer keeps pointers to (parameters and gradients) must have the TARGET (or POINTER)
! attribute in the caller and must neither move nor be deallocated before dion_destroy or a rebind: libdion
! reads and writes them during dion_step, which the compiler cannot see. See README.md.
!
! Compile: gfortran -std=f2008 -c dion.f90   (link with -ldion)
module dion_enums
  use, intrinsic :: iso_c_binding, only: c_int32_t
  implicit none
  public

  ! Versions
  integer(c_int32_t), parameter :: DION_VERSION_MAJOR = 0
  integer(c_int32_t), parameter :: DION_VERSION_MINOR = 1
  integer(c_int32_t), parameter :: DION_VERSION_PATCH = 0
  integer(c_int32_t), parameter :: DION_VERSION_CODE = DION_VERSION_MAJOR * 10000 + DION_VERSION_MINOR * 100 &
                                                       + DION_VERSION_PATCH
  integer(c_int32_t), parameter :: DION_ABI_VERSION = 1

  ! dion_status_t
  integer(c_int32_t), parameter :: DION_SUCCESS = 0
  integer(c_int32_t), parameter :: DION_ERROR_INVALID_ARGUMENT = 1
  integer(c_int32_t), parameter :: DION_ERROR_INVALID_USAGE = 2
  integer(c_int32_t), parameter :: DION_ERROR_NOT_SUPPORTED = 3
  integer(c_int32_t), parameter :: DION_ERROR_OUT_OF_MEMORY = 4
  integer(c_int32_t), parameter :: DION_ERROR_CUDA = 5
  integer(c_int32_t), parameter :: DION_ERROR_CUBLAS = 6
  integer(c_int32_t), parameter :: DION_ERROR_CUSOLVER = 7
  integer(c_int32_t), parameter :: DION_ERROR_NCCL = 8
  integer(c_int32_t), parameter :: DION_ERROR_MPI = 9
  integer(c_int32_t), parameter :: DION_ERROR_NUMERICAL = 10
  integer(c_int32_t), parameter :: DION_ERROR_INTERNAL = 11

  ! dion_dtype_t
  integer(c_int32_t), parameter :: DION_DTYPE_UNSET = -1
  integer(c_int32_t), parameter :: DION_DTYPE_FP32 = 0
  integer(c_int32_t), parameter :: DION_DTYPE_BF16 = 1
  integer(c_int32_t), parameter :: DION_DTYPE_FP16 = 2

  ! dion_backend_t
  integer(c_int32_t), parameter :: DION_BACKEND_HOST = 0
  integer(c_int32_t), parameter :: DION_BACKEND_CUDA = 1

  ! dion_algorithm_t
  integer(c_int32_t), parameter :: DION_ALGO_DION = 0
  integer(c_int32_t), parameter :: DION_ALGO_DION2 = 1
  integer(c_int32_t), parameter :: DION_ALGO_MUON = 2
  integer(c_int32_t), parameter :: DION_ALGO_NORMUON = 3
  integer(c_int32_t), parameter :: DION_ALGO_NORDION2 = 4
  integer(c_int32_t), parameter :: DION_ALGO_DION3 = 4
  integer(c_int32_t), parameter :: DION_ALGO_ADAMW = 5
  integer(c_int32_t), parameter :: DION_ALGO_LION = 6

  ! dion_qr_method_t
  integer(c_int32_t), parameter :: DION_QR_RCQR = 0
  integer(c_int32_t), parameter :: DION_QR_QR = 1
  integer(c_int32_t), parameter :: DION_QR_CQR = 2

  ! dion_orthogonalizer_t
  integer(c_int32_t), parameter :: DION_ORTHO_POLAR_EXPRESS = 0
  integer(c_int32_t), parameter :: DION_ORTHO_NEWTON_SCHULZ = 1

  ! dion_adjust_lr_t
  integer(c_int32_t), parameter :: DION_ADJUST_LR_SPECTRAL_NORM = 0
  integer(c_int32_t), parameter :: DION_ADJUST_LR_RMS_NORM = 1
  integer(c_int32_t), parameter :: DION_ADJUST_LR_NONE = 2

  ! dion_selection_scope_t
  integer(c_int32_t), parameter :: DION_SELECTION_LOCAL = 0
  integer(c_int32_t), parameter :: DION_SELECTION_GLOBAL = 1

  ! dion_matmul_precision_t
  integer(c_int32_t), parameter :: DION_MATMUL_FP32 = 0
  integer(c_int32_t), parameter :: DION_MATMUL_TF32 = 1
  integer(c_int32_t), parameter :: DION_MATMUL_BF16 = 2

  ! dion_layout_t
  integer(c_int32_t), parameter :: DION_LAYOUT_ROW_MAJOR = 0
  integer(c_int32_t), parameter :: DION_LAYOUT_COL_MAJOR = 1

  ! dion_mesh_t
  integer(c_int32_t), parameter :: DION_MESH_REPLICATE = 0
  integer(c_int32_t), parameter :: DION_MESH_OUTER = 1
  integer(c_int32_t), parameter :: DION_MESH_INNER = 2

  ! dion_hparam_t
  integer(c_int32_t), parameter :: DION_HPARAM_LR = 0
  integer(c_int32_t), parameter :: DION_HPARAM_WEIGHT_DECAY = 1
  integer(c_int32_t), parameter :: DION_HPARAM_MU = 2
  integer(c_int32_t), parameter :: DION_HPARAM_BETA1 = 3
  integer(c_int32_t), parameter :: DION_HPARAM_BETA2 = 4
  integer(c_int32_t), parameter :: DION_HPARAM_EPSILON = 5
  integer(c_int32_t), parameter :: DION_HPARAM_EF_DECAY = 6
  integer(c_int32_t), parameter :: DION_HPARAM_MUON_BETA2 = 7

  ! Sentinel of integer option fields meaning "use the default" (-2147483647 - 1).
  integer(c_int32_t), parameter :: DION_UNSET_INT = -huge(0_c_int32_t) - 1_c_int32_t

  integer(c_int32_t), parameter :: DION_NCCL_UNIQUE_ID_BYTES = 128
  integer(c_int32_t), parameter :: DION_MAX_DIMS = 4
end module dion_enums

module dion
  use, intrinsic :: iso_c_binding, only: c_ptr, c_null_ptr, c_char, c_null_char, c_int32_t, c_int64_t, c_size_t, &
                                         c_double, c_float, c_intptr_t, c_loc, c_f_pointer, c_associated
  use dion_enums
  implicit none
  private
  public :: DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH, DION_VERSION_CODE, DION_ABI_VERSION
  public :: DION_SUCCESS, DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE, DION_ERROR_NOT_SUPPORTED
  public :: DION_ERROR_OUT_OF_MEMORY, DION_ERROR_CUDA, DION_ERROR_CUBLAS, DION_ERROR_CUSOLVER, DION_ERROR_NCCL
  public :: DION_ERROR_MPI, DION_ERROR_NUMERICAL, DION_ERROR_INTERNAL
  public :: DION_DTYPE_UNSET, DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16
  public :: DION_BACKEND_HOST, DION_BACKEND_CUDA
  public :: DION_ALGO_DION, DION_ALGO_DION2, DION_ALGO_MUON, DION_ALGO_NORMUON, DION_ALGO_NORDION2, DION_ALGO_DION3
  public :: DION_ALGO_ADAMW, DION_ALGO_LION
  public :: DION_QR_RCQR, DION_QR_QR, DION_QR_CQR
  public :: DION_ORTHO_POLAR_EXPRESS, DION_ORTHO_NEWTON_SCHULZ
  public :: DION_ADJUST_LR_SPECTRAL_NORM, DION_ADJUST_LR_RMS_NORM, DION_ADJUST_LR_NONE
  public :: DION_SELECTION_LOCAL, DION_SELECTION_GLOBAL
  public :: DION_MATMUL_FP32, DION_MATMUL_TF32, DION_MATMUL_BF16
  public :: DION_LAYOUT_ROW_MAJOR, DION_LAYOUT_COL_MAJOR
  public :: DION_MESH_REPLICATE, DION_MESH_OUTER, DION_MESH_INNER
  public :: DION_HPARAM_LR, DION_HPARAM_WEIGHT_DECAY, DION_HPARAM_MU, DION_HPARAM_BETA1, DION_HPARAM_BETA2
  public :: DION_HPARAM_EPSILON, DION_HPARAM_EF_DECAY, DION_HPARAM_MUON_BETA2
  public :: DION_UNSET_INT, DION_NCCL_UNIQUE_ID_BYTES, DION_MAX_DIMS

  ! ---------------------------------------------------------------------------------------------------------------
  ! Structs (layouts mirror dion.h field for field; tests/test_dion.f90 checks sizes and the *_init defaults)
  ! ---------------------------------------------------------------------------------------------------------------

  ! dion_nccl_unique_id_t
  type, bind(C), public :: dion_nccl_unique_id_t
    character(kind=c_char) :: internal(DION_NCCL_UNIQUE_ID_BYTES)
  end type dion_nccl_unique_id_t

  ! dion_options_t (dion_options_v1)
  type, bind(C), public :: dion_options_t
    integer(c_size_t) :: struct_size
    integer(c_int32_t) :: abi_version         ! uint32_t in C
    integer(c_int32_t) :: backend             ! dion_backend_t
    integer(c_int32_t) :: device
    integer(c_int32_t) :: replicate_grad_sync
    integer(c_int32_t) :: skip_nonfinite
    integer(c_int32_t) :: reserved0
    integer(c_int64_t) :: seed                ! uint64_t in C
    type(c_ptr) :: replicate_comm             ! dion_comm_t
    type(c_ptr) :: outer_comm                 ! dion_comm_t
    type(c_ptr) :: inner_comm                 ! dion_comm_t
  end type dion_options_t

  ! dion_tensor_t (dion_tensor_v1)
  type, bind(C), public :: dion_tensor_t
    integer(c_size_t) :: struct_size
    type(c_ptr) :: name                       ! const char*
    type(c_ptr) :: param                      ! void*
    type(c_ptr) :: grad                       ! const void*
    integer(c_int32_t) :: param_dtype         ! dion_dtype_t
    integer(c_int32_t) :: grad_dtype          ! dion_dtype_t
    integer(c_int32_t) :: layout              ! dion_layout_t
    integer(c_int32_t) :: ndim
    integer(c_int64_t) :: shape(DION_MAX_DIMS) ! C order: shape(1) is C's shape[0]
    integer(c_int32_t) :: outer_shard_dim     ! 0-based C dim, -1: not sharded
    integer(c_int32_t) :: inner_shard_dim
    integer(c_int64_t) :: outer_offset
    integer(c_int64_t) :: outer_extent
    integer(c_int64_t) :: inner_offset
    integer(c_int64_t) :: inner_extent
  end type dion_tensor_t

  ! dion_group_options_t (dion_group_options_v1)
  type, bind(C), public :: dion_group_options_t
    integer(c_size_t) :: struct_size
    integer(c_int32_t) :: abi_version         ! uint32_t in C
    integer(c_int32_t) :: algorithm           ! dion_algorithm_t
    real(c_double) :: lr
    real(c_double) :: weight_decay
    real(c_double) :: mu
    real(c_double) :: beta1
    real(c_double) :: beta2
    real(c_double) :: epsilon
    real(c_double) :: rank_fraction
    integer(c_int32_t) :: rank_multiple_of
    integer(c_int32_t) :: power_iters
    integer(c_int32_t) :: qr_method           ! dion_qr_method_t
    integer(c_int32_t) :: cqr_warmup_steps
    real(c_double) :: oversample
    integer(c_int32_t) :: orthogonalizer      ! dion_orthogonalizer_t
    integer(c_int32_t) :: ortho_steps
    integer(c_int32_t) :: nesterov
    integer(c_int32_t) :: adjust_lr           ! dion_adjust_lr_t
    integer(c_int32_t) :: cautious_wd
    real(c_double) :: fraction
    real(c_double) :: ef_decay
    integer(c_int32_t) :: selection_scope     ! dion_selection_scope_t
    real(c_double) :: muon_beta2
    integer(c_int32_t) :: flatten
    integer(c_int32_t) :: momentum_dtype      ! dion_dtype_t
    integer(c_int32_t) :: q_dtype             ! dion_dtype_t
    integer(c_int32_t) :: variance_dtype      ! dion_dtype_t
    integer(c_int32_t) :: matmul_precision    ! dion_matmul_precision_t
  end type dion_group_options_t

  ! dion_state_info_t (dion_state_info_v1); the caller sets struct_size = c_sizeof(info) before dion_state_info.
  type, bind(C), public :: dion_state_info_t
    integer(c_size_t) :: struct_size
    integer(c_int32_t) :: tensor
    integer(c_int32_t) :: group
    type(c_ptr) :: name                       ! const char*, owned by the optimizer: see dion_c_string
    integer(c_int32_t) :: dtype               ! dion_dtype_t
    integer(c_int32_t) :: layout              ! dion_layout_t
    integer(c_int32_t) :: ndim
    integer(c_int64_t) :: global_shape(DION_MAX_DIMS)
    integer(c_int64_t) :: local_shape(DION_MAX_DIMS)
    integer(c_int64_t) :: local_offset(DION_MAX_DIMS)
    integer(c_int64_t) :: local_bytes         ! uint64_t in C
  end type dion_state_info_t

  ! ---------------------------------------------------------------------------------------------------------------
  ! The C API: one interface per function of dion.h, in header order, named as in C.
  ! ---------------------------------------------------------------------------------------------------------------
  public :: dion_version, dion_status_string
  public :: dion_nccl_get_unique_id, dion_comm_init_nccl, dion_comm_adopt_nccl, dion_comm_from_mpi_fint
  public :: dion_comm_size, dion_comm_rank, dion_comm_abort, dion_comm_destroy
  public :: dion_options_init, dion_options_sizeof, dion_create, dion_destroy, dion_last_error
  public :: dion_tensor_init, dion_tensor_sizeof, dion_group_options_init, dion_group_options_sizeof
  public :: dion_add_group, dion_group_count, dion_tensor_count, dion_group_set_hparam, dion_group_get_hparam
  public :: dion_group_get_step, dion_group_set_step, dion_tensor_rebind
  public :: dion_step, dion_sync_for_checkpoint, dion_get_skipped_steps, dion_get_async_error
  public :: dion_get_comm_bytes, dion_get_memory_usage
  public :: dion_state_count, dion_state_info, dion_state_find, dion_state_read, dion_state_write

  interface
    ! int32_t dion_version(void);
    function dion_version() bind(C, name="dion_version")
      import :: c_int32_t
      integer(c_int32_t) :: dion_version
    end function dion_version

    ! const char* dion_status_string(dion_status_t status);
    function dion_status_string(status) bind(C, name="dion_status_string")
      import :: c_ptr, c_int32_t
      integer(c_int32_t), value :: status
      type(c_ptr) :: dion_status_string
    end function dion_status_string

    ! dion_status_t dion_nccl_get_unique_id(dion_nccl_unique_id_t* id);
    function dion_nccl_get_unique_id(id) bind(C, name="dion_nccl_get_unique_id")
      import :: c_int32_t, dion_nccl_unique_id_t
      type(dion_nccl_unique_id_t), intent(out) :: id
      integer(c_int32_t) :: dion_nccl_get_unique_id
    end function dion_nccl_get_unique_id

    ! dion_status_t dion_comm_init_nccl(dion_comm_t* comm, const dion_nccl_unique_id_t* id, int32_t nranks,
    !                                   int32_t rank, int32_t device);
    function dion_comm_init_nccl(comm, id, nranks, rank, device) bind(C, name="dion_comm_init_nccl")
      import :: c_ptr, c_int32_t, dion_nccl_unique_id_t
      type(c_ptr), intent(out) :: comm
      type(dion_nccl_unique_id_t), intent(in) :: id
      integer(c_int32_t), value :: nranks
      integer(c_int32_t), value :: rank
      integer(c_int32_t), value :: device
      integer(c_int32_t) :: dion_comm_init_nccl
    end function dion_comm_init_nccl

    ! dion_status_t dion_comm_adopt_nccl(dion_comm_t* comm, struct ncclComm* nccl_comm);
    function dion_comm_adopt_nccl(comm, nccl_comm) bind(C, name="dion_comm_adopt_nccl")
      import :: c_ptr, c_int32_t
      type(c_ptr), intent(out) :: comm
      type(c_ptr), value :: nccl_comm
      integer(c_int32_t) :: dion_comm_adopt_nccl
    end function dion_comm_adopt_nccl

    ! dion_status_t dion_comm_from_mpi_fint(dion_comm_t* comm, int32_t fortran_comm);
    ! fortran_comm: an `integer` MPI communicator (use mpi), or comm%MPI_VAL (use mpi_f08).
    function dion_comm_from_mpi_fint(comm, fortran_comm) bind(C, name="dion_comm_from_mpi_fint")
      import :: c_ptr, c_int32_t
      type(c_ptr), intent(out) :: comm
      integer(c_int32_t), value :: fortran_comm
      integer(c_int32_t) :: dion_comm_from_mpi_fint
    end function dion_comm_from_mpi_fint

    ! dion_status_t dion_comm_size(dion_comm_t comm, int32_t* size);
    function dion_comm_size(comm, size) bind(C, name="dion_comm_size")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: comm
      integer(c_int32_t), intent(out) :: size
      integer(c_int32_t) :: dion_comm_size
    end function dion_comm_size

    ! dion_status_t dion_comm_rank(dion_comm_t comm, int32_t* rank);
    function dion_comm_rank(comm, rank) bind(C, name="dion_comm_rank")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: comm
      integer(c_int32_t), intent(out) :: rank
      integer(c_int32_t) :: dion_comm_rank
    end function dion_comm_rank

    ! dion_status_t dion_comm_abort(dion_comm_t comm);
    function dion_comm_abort(comm) bind(C, name="dion_comm_abort")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: comm
      integer(c_int32_t) :: dion_comm_abort
    end function dion_comm_abort

    ! dion_status_t dion_comm_destroy(dion_comm_t comm);
    function dion_comm_destroy(comm) bind(C, name="dion_comm_destroy")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: comm
      integer(c_int32_t) :: dion_comm_destroy
    end function dion_comm_destroy

    ! dion_status_t dion_options_init(dion_options_t* options);
    function dion_options_init(options) bind(C, name="dion_options_init")
      import :: c_int32_t, dion_options_t
      type(dion_options_t), intent(out) :: options
      integer(c_int32_t) :: dion_options_init
    end function dion_options_init

    ! size_t dion_options_sizeof(void);
    function dion_options_sizeof() bind(C, name="dion_options_sizeof")
      import :: c_size_t
      integer(c_size_t) :: dion_options_sizeof
    end function dion_options_sizeof

    ! dion_status_t dion_create(dion_optimizer_t* optimizer, const dion_options_t* options);
    ! (C accepts options = NULL for all defaults; from Fortran pass an options struct filled by dion_options_init.)
    function dion_create(optimizer, options) bind(C, name="dion_create")
      import :: c_ptr, c_int32_t, dion_options_t
      type(c_ptr), intent(out) :: optimizer
      type(dion_options_t), intent(in) :: options
      integer(c_int32_t) :: dion_create
    end function dion_create

    ! dion_status_t dion_destroy(dion_optimizer_t optimizer);
    function dion_destroy(optimizer) bind(C, name="dion_destroy")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t) :: dion_destroy
    end function dion_destroy

    ! const char* dion_last_error(dion_optimizer_t optimizer);   (see dion_error_message)
    function dion_last_error(optimizer) bind(C, name="dion_last_error")
      import :: c_ptr
      type(c_ptr), value :: optimizer
      type(c_ptr) :: dion_last_error
    end function dion_last_error

    ! dion_status_t dion_tensor_init(dion_tensor_t* tensor);
    function dion_tensor_init(tensor) bind(C, name="dion_tensor_init")
      import :: c_int32_t, dion_tensor_t
      type(dion_tensor_t), intent(out) :: tensor
      integer(c_int32_t) :: dion_tensor_init
    end function dion_tensor_init

    ! size_t dion_tensor_sizeof(void);
    function dion_tensor_sizeof() bind(C, name="dion_tensor_sizeof")
      import :: c_size_t
      integer(c_size_t) :: dion_tensor_sizeof
    end function dion_tensor_sizeof

    ! dion_status_t dion_group_options_init(dion_group_options_t* options, dion_algorithm_t algorithm);
    function dion_group_options_init(options, algorithm) bind(C, name="dion_group_options_init")
      import :: c_int32_t, dion_group_options_t
      type(dion_group_options_t), intent(out) :: options
      integer(c_int32_t), value :: algorithm
      integer(c_int32_t) :: dion_group_options_init
    end function dion_group_options_init

    ! size_t dion_group_options_sizeof(void);
    function dion_group_options_sizeof() bind(C, name="dion_group_options_sizeof")
      import :: c_size_t
      integer(c_size_t) :: dion_group_options_sizeof
    end function dion_group_options_sizeof

    ! dion_status_t dion_add_group(dion_optimizer_t optimizer, const dion_group_options_t* options,
    !                              const dion_tensor_t* tensors, size_t count, int32_t* group_index);
    ! (see dion_add_tensors for a wrapper that takes count from size(tensors) and tensor names as strings)
    function dion_add_group(optimizer, options, tensors, count, group_index) bind(C, name="dion_add_group")
      import :: c_ptr, c_int32_t, c_size_t, dion_group_options_t, dion_tensor_t
      type(c_ptr), value :: optimizer
      type(dion_group_options_t), intent(in) :: options
      type(dion_tensor_t), intent(in) :: tensors(*)
      integer(c_size_t), value :: count
      integer(c_int32_t), intent(out) :: group_index
      integer(c_int32_t) :: dion_add_group
    end function dion_add_group

    ! dion_status_t dion_group_count(dion_optimizer_t optimizer, int32_t* count);
    function dion_group_count(optimizer, count) bind(C, name="dion_group_count")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), intent(out) :: count
      integer(c_int32_t) :: dion_group_count
    end function dion_group_count

    ! dion_status_t dion_tensor_count(dion_optimizer_t optimizer, int32_t* count);
    function dion_tensor_count(optimizer, count) bind(C, name="dion_tensor_count")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), intent(out) :: count
      integer(c_int32_t) :: dion_tensor_count
    end function dion_tensor_count

    ! dion_status_t dion_group_set_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
    !                                     double value);
    function dion_group_set_hparam(optimizer, group, hparam, value) bind(C, name="dion_group_set_hparam")
      import :: c_ptr, c_int32_t, c_double
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: group
      integer(c_int32_t), value :: hparam
      real(c_double), value :: value
      integer(c_int32_t) :: dion_group_set_hparam
    end function dion_group_set_hparam

    ! dion_status_t dion_group_get_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
    !                                     double* value);
    function dion_group_get_hparam(optimizer, group, hparam, value) bind(C, name="dion_group_get_hparam")
      import :: c_ptr, c_int32_t, c_double
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: group
      integer(c_int32_t), value :: hparam
      real(c_double), intent(out) :: value
      integer(c_int32_t) :: dion_group_get_hparam
    end function dion_group_get_hparam

    ! dion_status_t dion_group_get_step(dion_optimizer_t optimizer, int32_t group, int64_t* step);
    function dion_group_get_step(optimizer, group, step) bind(C, name="dion_group_get_step")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: group
      integer(c_int64_t), intent(out) :: step
      integer(c_int32_t) :: dion_group_get_step
    end function dion_group_get_step

    ! dion_status_t dion_group_set_step(dion_optimizer_t optimizer, int32_t group, int64_t step);
    function dion_group_set_step(optimizer, group, step) bind(C, name="dion_group_set_step")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: group
      integer(c_int64_t), value :: step
      integer(c_int32_t) :: dion_group_set_step
    end function dion_group_set_step

    ! dion_status_t dion_tensor_rebind(dion_optimizer_t optimizer, int32_t tensor, void* param, const void* grad);
    function dion_tensor_rebind(optimizer, tensor, param, grad) bind(C, name="dion_tensor_rebind")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: tensor
      type(c_ptr), value :: param
      type(c_ptr), value :: grad
      integer(c_int32_t) :: dion_tensor_rebind
    end function dion_tensor_rebind

    ! dion_status_t dion_step(dion_optimizer_t optimizer, dion_stream_t stream);
    function dion_step(optimizer, stream) bind(C, name="dion_step")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      type(c_ptr), value :: stream
      integer(c_int32_t) :: dion_step
    end function dion_step

    ! dion_status_t dion_sync_for_checkpoint(dion_optimizer_t optimizer, dion_stream_t stream);
    function dion_sync_for_checkpoint(optimizer, stream) bind(C, name="dion_sync_for_checkpoint")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      type(c_ptr), value :: stream
      integer(c_int32_t) :: dion_sync_for_checkpoint
    end function dion_sync_for_checkpoint

    ! dion_status_t dion_get_skipped_steps(dion_optimizer_t optimizer, int64_t* skipped, int32_t* last_skipped,
    !                                      dion_stream_t stream);
    function dion_get_skipped_steps(optimizer, skipped, last_skipped, stream) bind(C, name="dion_get_skipped_steps")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int64_t), intent(out) :: skipped
      integer(c_int32_t), intent(out) :: last_skipped
      type(c_ptr), value :: stream
      integer(c_int32_t) :: dion_get_skipped_steps
    end function dion_get_skipped_steps

    ! dion_status_t dion_get_async_error(dion_optimizer_t optimizer, dion_status_t* status);
    function dion_get_async_error(optimizer, status) bind(C, name="dion_get_async_error")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), intent(out) :: status
      integer(c_int32_t) :: dion_get_async_error
    end function dion_get_async_error

    ! dion_status_t dion_get_comm_bytes(dion_optimizer_t optimizer, dion_mesh_t mesh, uint64_t* last_step,
    !                                   uint64_t* total);
    function dion_get_comm_bytes(optimizer, mesh, last_step, total) bind(C, name="dion_get_comm_bytes")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: mesh
      integer(c_int64_t), intent(out) :: last_step
      integer(c_int64_t), intent(out) :: total
      integer(c_int32_t) :: dion_get_comm_bytes
    end function dion_get_comm_bytes

    ! dion_status_t dion_get_memory_usage(dion_optimizer_t optimizer, uint64_t* state_bytes,
    !                                     uint64_t* workspace_bytes);
    function dion_get_memory_usage(optimizer, state_bytes, workspace_bytes) bind(C, name="dion_get_memory_usage")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int64_t), intent(out) :: state_bytes
      integer(c_int64_t), intent(out) :: workspace_bytes
      integer(c_int32_t) :: dion_get_memory_usage
    end function dion_get_memory_usage

    ! dion_status_t dion_state_count(dion_optimizer_t optimizer, int32_t* count);
    function dion_state_count(optimizer, count) bind(C, name="dion_state_count")
      import :: c_ptr, c_int32_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), intent(out) :: count
      integer(c_int32_t) :: dion_state_count
    end function dion_state_count

    ! dion_status_t dion_state_info(dion_optimizer_t optimizer, int32_t index, dion_state_info_t* info);
    function dion_state_info(optimizer, index, info) bind(C, name="dion_state_info")
      import :: c_ptr, c_int32_t, dion_state_info_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: index
      type(dion_state_info_t), intent(inout) :: info
      integer(c_int32_t) :: dion_state_info
    end function dion_state_info

    ! dion_status_t dion_state_find(dion_optimizer_t optimizer, int32_t tensor, const char* name, int32_t* index);
    ! name must end with c_null_char (see dion_find_state for a wrapper taking a Fortran string).
    function dion_state_find(optimizer, tensor, name, index) bind(C, name="dion_state_find")
      import :: c_ptr, c_int32_t, c_char
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: tensor
      character(kind=c_char), intent(in) :: name(*)
      integer(c_int32_t), intent(out) :: index
      integer(c_int32_t) :: dion_state_find
    end function dion_state_find

    ! dion_status_t dion_state_read(dion_optimizer_t optimizer, int32_t index, void* dst, uint64_t bytes,
    !                               dion_stream_t stream);
    function dion_state_read(optimizer, index, dst, bytes, stream) bind(C, name="dion_state_read")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: index
      type(c_ptr), value :: dst
      integer(c_int64_t), value :: bytes
      type(c_ptr), value :: stream
      integer(c_int32_t) :: dion_state_read
    end function dion_state_read

    ! dion_status_t dion_state_write(dion_optimizer_t optimizer, int32_t index, const void* src, uint64_t bytes,
    !                                dion_stream_t stream);
    function dion_state_write(optimizer, index, src, bytes, stream) bind(C, name="dion_state_write")
      import :: c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: optimizer
      integer(c_int32_t), value :: index
      type(c_ptr), value :: src
      integer(c_int64_t), value :: bytes
      type(c_ptr), value :: stream
      integer(c_int32_t) :: dion_state_write
    end function dion_state_write
  end interface

  ! ---------------------------------------------------------------------------------------------------------------
  ! Fortran-friendly procedures (no new C symbols: each is written over the interfaces above)
  ! ---------------------------------------------------------------------------------------------------------------
  public :: dion_c_string, dion_status_message, dion_error_message
  public :: dion_tensor_2d, dion_tensor_1d, dion_tensor_ptr, dion_add_tensors
  public :: dion_rebind_2d, dion_rebind_1d, dion_find_state, dion_read_state, dion_write_state

  ! Reads a state buffer into / writes it from a contiguous real(c_float) array of rank 1 or 2.
  interface dion_read_state
    module procedure dion_read_state_1d, dion_read_state_2d
  end interface dion_read_state
  interface dion_write_state
    module procedure dion_write_state_1d, dion_write_state_2d
  end interface dion_write_state

contains

  ! A Fortran copy of a NUL-terminated C string ('' for a NULL pointer).
  function dion_c_string(cstr) result(str)
    type(c_ptr), intent(in) :: cstr
    character(len=:), allocatable :: str
    character(kind=c_char), pointer :: chars(:)
    integer :: n

    if (.not. c_associated(cstr)) then
      str = ''
      return
    end if
    ! Find the terminating NUL through a pointer of growing length: Fortran cannot call strlen without binding
    ! it, and binding libc is outside the type table.
    call c_f_pointer(cstr, chars, [huge(0)])
    n = 0
    do while (chars(n + 1) /= c_null_char)
      n = n + 1
    end do
    allocate (character(len=n) :: str)
    str = transfer(chars(1:n), str)
  end function dion_c_string

  ! dion_status_string(status) as a Fortran string.
  function dion_status_message(status) result(msg)
    integer(c_int32_t), intent(in) :: status
    character(len=:), allocatable :: msg
    msg = dion_c_string(dion_status_string(status))
  end function dion_status_message

  ! dion_last_error(optimizer) as a Fortran string; pass c_null_ptr for the calling thread's last error (the one
  ! to read after a failed dion_create).
  function dion_error_message(optimizer) result(msg)
    type(c_ptr), intent(in) :: optimizer
    character(len=:), allocatable :: msg
    msg = dion_c_string(dion_last_error(optimizer))
  end function dion_error_message

  ! Address of a scalar as an integer, to check array strides.
  pure function address_of(p) result(a)
    type(c_ptr), intent(in) :: p
    integer(c_intptr_t) :: a
    a = transfer(p, a)
  end function address_of

  ! .true. when x is dense in column-major order (no gaps, no reversed or strided section). The dummy is not
  ! CONTIGUOUS on purpose: a CONTIGUOUS dummy makes the compiler pass a temporary copy of a strided actual
  ! argument, and the optimizer would keep a pointer to that copy. Here nothing is ever copied; a strided array
  ! is rejected instead.
  function dense_2d(x) result(dense)
    real(c_float), target, intent(in) :: x(:, :)
    logical :: dense
    dense = .true.
    if (size(x) == 0) return
    if (size(x, 1) > 1) then
      dense = address_of(c_loc(x(2, 1))) - address_of(c_loc(x(1, 1))) == 4
    end if
    if (dense .and. size(x, 2) > 1) then
      dense = address_of(c_loc(x(1, 2))) - address_of(c_loc(x(1, 1))) == 4_c_intptr_t * size(x, 1, kind=c_intptr_t)
    end if
  end function dense_2d

  function dense_1d(x) result(dense)
    real(c_float), target, intent(in) :: x(:)
    logical :: dense
    dense = .true.
    if (size(x) > 1) dense = address_of(c_loc(x(2))) - address_of(c_loc(x(1))) == 4
  end function dense_1d

  ! Describes a Fortran matrix param(m, n) (and its gradient of the same shape) WITHOUT copying it: layout
  ! DION_LAYOUT_COL_MAJOR, logical shape (m, n) = (fan_out, fan_in), as torch.nn.Linear's weight. Both arrays
  ! must have the TARGET attribute in the caller and stay where they are while the optimizer uses them. Without
  ! `grad` the tensor has no gradient (it is skipped until dion_rebind_2d gives one). Returns
  ! DION_ERROR_INVALID_ARGUMENT (and leaves tensor unchanged) if an array is not dense or the shapes differ.
  function dion_tensor_2d(tensor, param, grad) result(status)
    type(dion_tensor_t), intent(inout) :: tensor
    real(c_float), target, intent(inout) :: param(:, :)
    real(c_float), target, intent(in), optional :: grad(:, :)
    integer(c_int32_t) :: status
    type(dion_tensor_t) :: t

    status = DION_ERROR_INVALID_ARGUMENT
    if (size(param) == 0 .or. .not. dense_2d(param)) return
    status = dion_tensor_init(t)
    if (status /= DION_SUCCESS) return
    t%param = c_loc(param(1, 1))
    t%grad = c_null_ptr
    if (present(grad)) then
      status = DION_ERROR_INVALID_ARGUMENT
      if (any(shape(grad) /= shape(param)) .or. .not. dense_2d(grad)) return
      t%grad = c_loc(grad(1, 1))
    end if
    t%param_dtype = DION_DTYPE_FP32
    t%grad_dtype = DION_DTYPE_FP32
    t%layout = DION_LAYOUT_COL_MAJOR
    t%ndim = 2
    t%shape = 0
    t%shape(1) = size(param, 1, kind=c_int64_t)
    t%shape(2) = size(param, 2, kind=c_int64_t)
    tensor = t
    status = DION_SUCCESS
  end function dion_tensor_2d

  ! Describes a vector param(n) (a bias, a norm's gain) and its gradient: ndim 1, shape (n). Same rules as
  ! dion_tensor_2d.
  function dion_tensor_1d(tensor, param, grad) result(status)
    type(dion_tensor_t), intent(inout) :: tensor
    real(c_float), target, intent(inout) :: param(:)
    real(c_float), target, intent(in), optional :: grad(:)
    integer(c_int32_t) :: status
    type(dion_tensor_t) :: t

    status = DION_ERROR_INVALID_ARGUMENT
    if (size(param) == 0 .or. .not. dense_1d(param)) return
    status = dion_tensor_init(t)
    if (status /= DION_SUCCESS) return
    t%param = c_loc(param(1))
    t%grad = c_null_ptr
    if (present(grad)) then
      status = DION_ERROR_INVALID_ARGUMENT
      if (size(grad) /= size(param) .or. .not. dense_1d(grad)) return
      t%grad = c_loc(grad(1))
    end if
    t%param_dtype = DION_DTYPE_FP32
    t%grad_dtype = DION_DTYPE_FP32
    t%layout = DION_LAYOUT_ROW_MAJOR
    t%ndim = 1
    t%shape = 0
    t%shape(1) = size(param, kind=c_int64_t)
    tensor = t
    status = DION_SUCCESS
  end function dion_tensor_1d

  ! Describes a buffer given by address (device memory from CUDA Fortran or OpenACC's host_data use_device, bf16
  ! or fp16 data, tensors of 3 or 4 dims): shape in C order (shape(1) is C's shape[0]), layout row-major unless
  ! given. grad may be c_null_ptr.
  function dion_tensor_ptr(tensor, param, grad, dtype, shape, layout) result(status)
    type(dion_tensor_t), intent(inout) :: tensor
    type(c_ptr), intent(in) :: param
    type(c_ptr), intent(in) :: grad
    integer(c_int32_t), intent(in) :: dtype
    integer(c_int64_t), intent(in) :: shape(:)
    integer(c_int32_t), intent(in), optional :: layout
    integer(c_int32_t) :: status
    type(dion_tensor_t) :: t

    status = DION_ERROR_INVALID_ARGUMENT
    if (size(shape) > DION_MAX_DIMS) return
    status = dion_tensor_init(t)
    if (status /= DION_SUCCESS) return
    t%param = param
    t%grad = grad
    t%param_dtype = dtype
    t%grad_dtype = dtype
    t%layout = DION_LAYOUT_ROW_MAJOR
    if (present(layout)) t%layout = layout
    t%ndim = size(shape, kind=c_int32_t)
    t%shape = 0
    t%shape(1:size(shape)) = shape
    tensor = t
    status = DION_SUCCESS
  end function dion_tensor_ptr

  ! dion_add_group with count = size(tensors) and optional tensor names (used in libdion's error messages; the
  ! library copies them). group_index receives the new group's number.
  function dion_add_tensors(optimizer, options, tensors, group_index, names) result(status)
    type(c_ptr), intent(in) :: optimizer
    type(dion_group_options_t), intent(in) :: options
    type(dion_tensor_t), intent(in) :: tensors(:)
    integer(c_int32_t), intent(out) :: group_index
    character(len=*), intent(in), optional :: names(:)
    integer(c_int32_t) :: status
    type(dion_tensor_t), allocatable :: descs(:)
    character(kind=c_char), allocatable, target :: buf(:, :)
    integer :: i, j, width

    group_index = -1
    allocate (descs(max(1, size(tensors))))
    if (size(tensors) > 0) descs(1:size(tensors)) = tensors
    if (present(names)) then
      status = DION_ERROR_INVALID_ARGUMENT
      if (size(names) /= size(tensors)) return
      width = len(names) + 1
      allocate (buf(width, max(1, size(names))))
      do i = 1, size(names)
        buf(:, i) = c_null_char
        do j = 1, len_trim(names(i))
          buf(j, i) = names(i)(j:j)
        end do
        descs(i)%name = c_loc(buf(1, i))
      end do
    end if
    status = dion_add_group(optimizer, options, descs, size(tensors, kind=c_size_t), group_index)
  end function dion_add_tensors

  ! dion_tensor_rebind for a matrix described by dion_tensor_2d (same shape; grad absent: no gradient).
  function dion_rebind_2d(optimizer, tensor, param, grad) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: tensor
    real(c_float), target, intent(inout) :: param(:, :)
    real(c_float), target, intent(in), optional :: grad(:, :)
    integer(c_int32_t) :: status
    type(c_ptr) :: g

    status = DION_ERROR_INVALID_ARGUMENT
    if (size(param) == 0 .or. .not. dense_2d(param)) return
    g = c_null_ptr
    if (present(grad)) then
      if (any(shape(grad) /= shape(param)) .or. .not. dense_2d(grad)) return
      g = c_loc(grad(1, 1))
    end if
    status = dion_tensor_rebind(optimizer, tensor, c_loc(param(1, 1)), g)
  end function dion_rebind_2d

  ! dion_tensor_rebind for a vector described by dion_tensor_1d.
  function dion_rebind_1d(optimizer, tensor, param, grad) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: tensor
    real(c_float), target, intent(inout) :: param(:)
    real(c_float), target, intent(in), optional :: grad(:)
    integer(c_int32_t) :: status
    type(c_ptr) :: g

    status = DION_ERROR_INVALID_ARGUMENT
    if (size(param) == 0 .or. .not. dense_1d(param)) return
    g = c_null_ptr
    if (present(grad)) then
      if (size(grad) /= size(param) .or. .not. dense_1d(grad)) return
      g = c_loc(grad(1))
    end if
    status = dion_tensor_rebind(optimizer, tensor, c_loc(param(1)), g)
  end function dion_rebind_1d

  ! dion_state_find with a Fortran string (trailing blanks ignored).
  function dion_find_state(optimizer, tensor, name, index) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: tensor
    character(len=*), intent(in) :: name
    integer(c_int32_t), intent(out) :: index
    integer(c_int32_t) :: status
    character(kind=c_char) :: cname(len_trim(name) + 1)
    integer :: j

    do j = 1, len_trim(name)
      cname(j) = name(j:j)
    end do
    cname(len_trim(name) + 1) = c_null_char
    status = dion_state_find(optimizer, tensor, cname, index)
  end function dion_find_state

  ! State I/O through host arrays. A same-shaped state ("momentum", "variance") of a tensor added by
  ! dion_tensor_2d is column-major like the parameter, so it reads into an array shaped like the parameter;
  ! other states are row-major over local_shape (dion_state_info).
  function dion_read_state_1d(optimizer, index, dst) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: index
    real(c_float), target, intent(inout) :: dst(:)
    integer(c_int32_t) :: status
    status = DION_ERROR_INVALID_ARGUMENT
    if (size(dst) == 0 .or. .not. dense_1d(dst)) return
    status = dion_state_read(optimizer, index, c_loc(dst(1)), 4_c_int64_t * size(dst, kind=c_int64_t), c_null_ptr)
  end function dion_read_state_1d

  function dion_read_state_2d(optimizer, index, dst) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: index
    real(c_float), target, intent(inout) :: dst(:, :)
    integer(c_int32_t) :: status
    status = DION_ERROR_INVALID_ARGUMENT
    if (size(dst) == 0 .or. .not. dense_2d(dst)) return
    status = dion_state_read(optimizer, index, c_loc(dst(1, 1)), 4_c_int64_t * size(dst, kind=c_int64_t), c_null_ptr)
  end function dion_read_state_2d

  function dion_write_state_1d(optimizer, index, src) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: index
    real(c_float), target, intent(in) :: src(:)
    integer(c_int32_t) :: status
    status = DION_ERROR_INVALID_ARGUMENT
    if (size(src) == 0 .or. .not. dense_1d(src)) return
    status = dion_state_write(optimizer, index, c_loc(src(1)), 4_c_int64_t * size(src, kind=c_int64_t), c_null_ptr)
  end function dion_write_state_1d

  function dion_write_state_2d(optimizer, index, src) result(status)
    type(c_ptr), intent(in) :: optimizer
    integer(c_int32_t), intent(in) :: index
    real(c_float), target, intent(in) :: src(:, :)
    integer(c_int32_t) :: status
    status = DION_ERROR_INVALID_ARGUMENT
    if (size(src) == 0 .or. .not. dense_2d(src)) return
    status = dion_state_write(optimizer, index, c_loc(src(1, 1)), 4_c_int64_t * size(src, kind=c_int64_t), c_null_ptr)
  end function dion_write_state_2d
end module dion
