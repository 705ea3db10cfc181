"""The environment variables that choose a rank's data planes, and their choices: read by the PS
(:mod:`hetpipe.ps.core_plane`) and the stage transport (:mod:`hetpipe.transport.core`), checked up front
by :mod:`hetpipe.job.environment`."""

PS_PLANE_ENV, STAGE_PLANE_ENV = "HETPIPE_PS_PLANE", "HETPIPE_STAGE_PLANE"
PLANES = ("auto", "core", "python")
