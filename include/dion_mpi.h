/* SPDX-License-Identifier: MIT
 *
 * libdion entry points that take an MPI communicator. Include after <mpi.h>.
 * Available when libdion was built with MPI; dion.h's
 * dion_comm_from_mpi_fint serves callers that cannot include MPI headers. */
#ifndef DION_MPI_H_
#define DION_MPI_H_

#include <mpi.h>

#include "dion.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Wraps an MPI communicator for use as a libdion mesh (host backend). The
 * library duplicates it (MPI_Comm_dup, errors returned rather than fatal), so
 * the caller's communicator is untouched. Collective over mpi_comm. Free with
 * dion_comm_destroy before MPI_Finalize. */
DION_API dion_status_t dion_comm_from_mpi(dion_comm_t* comm, MPI_Comm mpi_comm);

#ifdef __cplusplus
}
#endif

#endif /* DION_MPI_H_ */
