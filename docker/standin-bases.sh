#!/usr/bin/env bash
# TEST HARNESS ONLY. Where no image registry answers, builds local stand-ins for the two public
# base images the compose file names, python:3.11-slim and redis:7-alpine, from Debian bookworm
# (debootstrap + `docker import`; bookworm's python3 is 3.11, its redis-server is 7.0). Each one is
# built only when the real image is neither present nor pullable. The stand-ins trust this host's
# CA bundle (copied in), which only a test harness should do: never ship or push them.
#
#   bash docker/standin-bases.sh          # called by scripts/compose_check.sh
#
# Needs root, debootstrap and a reachable Debian mirror ($DEBIAN_MIRROR).
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${CARPOOL_STANDIN_CACHE:-/var/tmp/carpool-standin}
PULL_TIMEOUT=${CARPOOL_PULL_TIMEOUT:-60}
HOST_CA=/etc/ssl/certs/ca-certificates.crt

log() { echo "standin-bases: $*" >&2; }  # stderr: functions answer on stdout

have_or_pull() {  # 0 when the real image is here or could be pulled
    docker image inspect "$1" >/dev/null 2>&1 && { log "$1 present"; return 0; }
    if timeout "$PULL_TIMEOUT" docker pull -q "$1" >/dev/null 2>&1; then log "$1 pulled"; return 0; fi
    return 1
}

bookworm_rootfs() {  # a minimal bookworm tree with python3, built once and kept in $CACHE
    local root=$CACHE/bookworm
    if [ ! -x "$root/usr/bin/python3" ]; then
        # stdout is the answer (the path): apt speaks on stderr.
        command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; } >&2
        rm -rf "$root" && mkdir -p "$CACHE"
        log "debootstrap bookworm into $root (a few minutes, once)"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
    fi
    echo "$root"
}

prepare() {  # prepare SRC DST: a copy of the rootfs to turn into one image
    rm -rf "$2" && cp -a "$1" "$2"
    [ -f "$HOST_CA" ] && cp "$HOST_CA" "$2/etc/ssl/certs/ca-certificates.crt"  # harness only
    printf '#!/bin/sh\nexit 101\n' >"$2/usr/sbin/policy-rc.d" && chmod +x "$2/usr/sbin/policy-rc.d"
}

slim() {  # drop what an image does not need (apt lists, docs, man pages, locales)
    rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb \
        "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/usr/share/info/* "$1"/var/log/*.log
    find "$1/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
}

import() {  # import DIR TAG CHANGES...
    local dir=$1 tag=$2; shift 2
    local args=(--change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin'
                --change 'ENV LANG=C.UTF-8' --change 'LABEL org.carpool.standin=test-harness-only')
    for change in "$@"; do args+=(--change "$change"); done
    tar -C "$dir" -c . | docker import "${args[@]}" - "$tag" >/dev/null
    log "$tag built as a stand-in ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec))"
}

if ! have_or_pull python:3.11-slim; then
    root=$(bookworm_rootfs)
    dir=$CACHE/python-slim
    prepare "$root" "$dir"
    # python:3.11-slim carries Python.h (torch's C++ extensions include it); bookworm keeps it here.
    chroot "$dir" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libpython3.11-dev' \
        >"$CACHE/python-apt.log" 2>&1 || { tail -20 "$CACHE/python-apt.log"; exit 1; }
    ln -sf /usr/bin/python3 "$dir/usr/local/bin/python"
    slim "$dir"
    import "$dir" python:3.11-slim 'CMD ["python3"]'
    rm -rf "$dir"
fi

if ! have_or_pull redis:7-alpine; then
    root=$(bookworm_rootfs)
    dir=$CACHE/redis
    prepare "$root" "$dir"
    chroot "$dir" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server' \
        >"$CACHE/redis-apt.log" 2>&1 || { tail -20 "$CACHE/redis-apt.log"; exit 1; }
    mkdir -p "$dir/data"
    # The official image builds Redis with protected mode off (it listens on a container network);
    # Debian's binary has it on, which refuses every client from another container.
    printf '#!/bin/sh\nexec /usr/bin/redis-server "$@" --protected-mode no\n' >"$dir/usr/local/bin/redis-server"
    chmod +x "$dir/usr/local/bin/redis-server"
    slim "$dir"
    import "$dir" redis:7-alpine 'WORKDIR /data' 'EXPOSE 6379' 'CMD ["redis-server"]'
    rm -rf "$dir"
fi
