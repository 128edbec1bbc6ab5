// SPDX-License-Identifier: MIT
// Communicator entry points: NCCL (unique id, init, adoption) and MPI
// (Fortran-handle wrapper; dion_mpi.h adds the MPI_Comm form). Each is
// NOT_SUPPORTED in a build without the library behind it.
#include <cstring>
#include <new>

#include "api_util.hpp"
#include "comm.hpp"

#if DION_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif
#if DION_WITH_MPI
#include <mpi.h>
#endif

using namespace dion;

namespace {
dion_comm_s* check_comm(dion_comm_t c, const char* fn) {
  if (!c) fail(DION_ERROR_INVALID_ARGUMENT, "%s: comm is NULL", fn);
  if (c->magic != kCommMagic) fail(DION_ERROR_INVALID_ARGUMENT, "%s: comm is not a valid dion_comm_t", fn);
  return c;
}
}  // namespace

DION_API dion_status_t dion_nccl_get_unique_id(dion_nccl_unique_id_t* id) {
  return api_call(nullptr, [&] {
    if (!id) fail(DION_ERROR_INVALID_ARGUMENT, "dion_nccl_get_unique_id: id is NULL");
#if DION_WITH_NCCL
    static_assert(sizeof(ncclUniqueId) == DION_NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size");
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) fail(DION_ERROR_NCCL, "dion_nccl_get_unique_id: ncclGetUniqueId: %s", ncclGetErrorString(r));
    std::memcpy(id->internal, &u, sizeof(u));
#else
    fail(DION_ERROR_NOT_SUPPORTED, "dion_nccl_get_unique_id: this libdion was built without NCCL");
#endif
  });
}

DION_API dion_status_t dion_comm_init_nccl(dion_comm_t* comm, const dion_nccl_unique_id_t* id, int32_t nranks,
                                           int32_t rank, int32_t device) {
  return api_call(nullptr, [&] {
    if (!comm) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_init_nccl: comm is NULL");
    *comm = nullptr;
    if (!id) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_init_nccl: id is NULL");
    if (nranks < 1 || rank < 0 || rank >= nranks)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_init_nccl: rank %d is not in [0, nranks = %d)", rank, nranks);
    if (device < 0) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_init_nccl: device = %d is negative", device);
#if DION_WITH_NCCL
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess) {
      cudaGetLastError();
      fail(DION_ERROR_CUDA, "dion_comm_init_nccl: cudaSetDevice(%d): %s", device, cudaGetErrorString(ce));
    }
    ncclUniqueId u;
    std::memcpy(&u, id->internal, sizeof(u));
    ncclComm_t nc = nullptr;
    ncclResult_t r = ncclCommInitRank(&nc, nranks, u, rank);
    if (r != ncclSuccess) fail(DION_ERROR_NCCL, "dion_comm_init_nccl: ncclCommInitRank: %s", ncclGetErrorString(r));
    auto* c = new dion_comm_s;
    c->kind = CommKind::kNcclOwned;
    c->size = nranks;
    c->rank = rank;
    c->handle = nc;
    *comm = c;
#else
    fail(DION_ERROR_NOT_SUPPORTED, "dion_comm_init_nccl: this libdion was built without NCCL");
#endif
  });
}

DION_API dion_status_t dion_comm_adopt_nccl(dion_comm_t* comm, struct ncclComm* nccl_comm) {
  return api_call(nullptr, [&] {
    if (!comm) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_adopt_nccl: comm is NULL");
    *comm = nullptr;
    if (!nccl_comm) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_adopt_nccl: nccl_comm is NULL");
#if DION_WITH_NCCL
    int n = 0, r = 0;
    ncclResult_t e = ncclCommCount(nccl_comm, &n);
    if (e == ncclSuccess) e = ncclCommUserRank(nccl_comm, &r);
    if (e != ncclSuccess) fail(DION_ERROR_NCCL, "dion_comm_adopt_nccl: %s", ncclGetErrorString(e));
    auto* c = new dion_comm_s;
    c->kind = CommKind::kNcclAdopted;
    c->size = n;
    c->rank = r;
    c->handle = nccl_comm;
    *comm = c;
#else
    fail(DION_ERROR_NOT_SUPPORTED, "dion_comm_adopt_nccl: this libdion was built without NCCL");
#endif
  });
}

#if DION_WITH_MPI
static dion_comm_s* wrap_mpi(MPI_Comm mc, const char* fn) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) fail(DION_ERROR_INVALID_USAGE, "%s: MPI is not initialized (call MPI_Init first)", fn);
  MPI_Comm dup;
  int e = MPI_Comm_dup(mc, &dup);
  if (e != MPI_SUCCESS) fail(DION_ERROR_MPI, "%s: MPI_Comm_dup failed (%d)", fn, e);
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  auto* c = new dion_comm_s;
  c->kind = CommKind::kMpi;
  MPI_Comm_size(dup, &c->size);
  MPI_Comm_rank(dup, &c->rank);
  c->handle = new MPI_Comm(dup);
  return c;
}

extern "C" DION_API dion_status_t dion_comm_from_mpi(dion_comm_t* comm, MPI_Comm mpi_comm) {
  return api_call(nullptr, [&] {
    if (!comm) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_from_mpi: comm is NULL");
    *comm = nullptr;
    if (mpi_comm == MPI_COMM_NULL) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_from_mpi: mpi_comm is MPI_COMM_NULL");
    *comm = wrap_mpi(mpi_comm, "dion_comm_from_mpi");
  });
}
#endif

DION_API dion_status_t dion_comm_from_mpi_fint(dion_comm_t* comm, int32_t fortran_comm) {
  return api_call(nullptr, [&] {
    if (!comm) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_from_mpi_fint: comm is NULL");
    *comm = nullptr;
#if DION_WITH_MPI
    int init = 0;
    MPI_Initialized(&init);
    if (!init) fail(DION_ERROR_INVALID_USAGE, "dion_comm_from_mpi_fint: MPI is not initialized (call MPI_Init first)");
    MPI_Comm mc = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_comm));
    if (mc == MPI_COMM_NULL) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_from_mpi_fint: the communicator is MPI_COMM_NULL");
    *comm = wrap_mpi(mc, "dion_comm_from_mpi_fint");
#else
    (void)fortran_comm;
    fail(DION_ERROR_NOT_SUPPORTED, "dion_comm_from_mpi_fint: this libdion was built without MPI");
#endif
  });
}

DION_API dion_status_t dion_comm_size(dion_comm_t comm, int32_t* size) {
  return api_call(nullptr, [&] {
    check_comm(comm, "dion_comm_size");
    if (!size) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_size: size is NULL");
    *size = comm->size;
  });
}

DION_API dion_status_t dion_comm_rank(dion_comm_t comm, int32_t* rank) {
  return api_call(nullptr, [&] {
    check_comm(comm, "dion_comm_rank");
    if (!rank) fail(DION_ERROR_INVALID_ARGUMENT, "dion_comm_rank: rank is NULL");
    *rank = comm->rank;
  });
}

DION_API dion_status_t dion_comm_abort(dion_comm_t comm) {
  return api_call(nullptr, [&] {
    check_comm(comm, "dion_comm_abort");
#if DION_WITH_NCCL
    if (comm->kind == CommKind::kNcclOwned && comm->handle && !comm->aborted)
      ncclCommAbort(static_cast<ncclComm_t>(comm->handle));
#endif
    comm->aborted = true;
  });
}

DION_API dion_status_t dion_comm_destroy(dion_comm_t comm) {
  if (!comm) return DION_SUCCESS;
  return api_call(nullptr, [&] {
    check_comm(comm, "dion_comm_destroy");
#if DION_WITH_NCCL
    if (comm->kind == CommKind::kNcclOwned && comm->handle && !comm->aborted)
      ncclCommDestroy(static_cast<ncclComm_t>(comm->handle));
#endif
#if DION_WITH_MPI
    if (comm->kind == CommKind::kMpi && comm->handle) {
      MPI_Comm* mc = static_cast<MPI_Comm*>(comm->handle);
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Comm_free(mc);
      delete mc;
    }
#endif
    comm->magic = 0;
    delete comm;
  });
}
