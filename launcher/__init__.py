"""The `carpool` command: starts the pieces as processes (api, worker, up), submits and watches
jobs, runs the local benchmark; and the local Redis it starts when none answers."""
