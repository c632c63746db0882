#!/bin/bash
# DiLoCo under Open MPI: NP processes, one per host of hosts.txt, one island each. The trainer
# finds its rank and the job's size through JAX's Open MPI detection: no --dist flags.
#
#   NP=2 RUN_DIR=/shared/runs/diloco bash examples/openmpi/run.sh [more trainer flags]
#
# JAX reads Open MPI 4.x's ORTE variables; under Open MPI 5 pass --dist.coordinator-address,
# --dist.num-processes and --dist.process-id (from $OMPI_COMM_WORLD_RANK) yourself.
set -euo pipefail
NP=${NP:-2}
RUN_DIR=${RUN_DIR:-runs/openmpi}

mpirun -np "$NP" --hostfile hosts.txt --map-by ppr:1:node python -m eqx_diloco.train --diloco.num-replicas "$NP" --run-dir "$RUN_DIR" "$@"
