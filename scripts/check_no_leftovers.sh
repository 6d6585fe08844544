#!/usr/bin/env bash
# The last step of `make test`: fails, naming them, if the tests left processes behind —
# a `snooze serve`, an nginx (master or orphaned worker) or a headless Chromium that
# a test started and did not stop. Each test starts them with its files in a temp
# folder named `snooze-*` (configs, state, nginx prefix, browser profile), so a process
# is counted as ours when its command line, working directory or an open file names
# such a folder; an nginx or Chromium whose working directory is this repository is
# ours too (nginx workers rewrite their command line; the tests start them from here).
# Processes of `make run`, or anyone else's nginx or browser, name neither.
#
# Files too: `check_no_leftovers.sh --before > LIST` (before the tests) lists the temp
# folder's `snooze-*` entries; `check_no_leftovers.sh LIST` (after) fails, naming them, if
# the tests left new ones (a test's model copies are hundreds of MiB: one `make test` that
# kept them once left 1.2 GiB in /tmp).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd -P)
tmp=$(cd "${TMPDIR:-/tmp}" && pwd -P)
ours() { find "$tmp" -mindepth 1 -maxdepth 1 -name 'snooze-*' -printf '%f\n' | LC_ALL=C sort; }

if [ "${1:-}" = --before ]; then
  ours
  exit 0
fi
before=${1:-}

# This script and its ancestors (make, a CI shell) are never leftovers.
ancestors=" "
pid=$$
while [ "$pid" -gt 1 ] 2>/dev/null; do
  ancestors="$ancestors$pid "
  pid=$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 1)
done

leftovers=()
for dir in /proc/[0-9]*; do
  pid=${dir#/proc/}
  case "$ancestors" in *" $pid "*) continue ;; esac
  exe=$(readlink "$dir/exe" 2>/dev/null) || continue
  name=$(basename "${exe% (deleted)}")
  case "$name" in
    snooze | nginx | chromium | chromium-browser | chrome | headless_shell | chrome_crashpad_handler) ;;
    *) continue ;;
  esac
  cmdline=$(tr '\0' ' ' <"$dir/cmdline" 2>/dev/null || true)
  cwd=$(readlink "$dir/cwd" 2>/dev/null || true)
  files=$(find "$dir/fd" -maxdepth 1 -type l -printf '%l\n' 2>/dev/null || true)
  ours=""
  if printf '%s\n%s\n%s\n' "$cmdline" "$cwd" "$files" | grep -q "$tmp/snooze-"; then
    ours=yes
  elif [ "$name" != snooze ] && case "$cwd" in "$root" | "$root"/*) true ;; *) false ;; esac; then
    ours=yes
  fi
  if [ -n "$ours" ]; then
    leftovers+=("  pid $pid ($name, in ${cwd:-?}): ${cmdline:0:200}")
  fi
done

status=0
if [ "${#leftovers[@]}" -gt 0 ]; then
  echo "the tests left ${#leftovers[@]} process(es) running:" >&2
  printf '%s\n' "${leftovers[@]}" >&2
  status=1
else
  echo "no process left behind by the tests"
fi

if [ -n "$before" ]; then
  left=$(ours | LC_ALL=C comm -13 "$before" - | sed "s|^|  $tmp/|")
  if [ -n "$left" ]; then
    echo "the tests left files in $tmp:" >&2
    printf '%s\n' "$left" >&2
    status=1
  else
    echo "no file left behind by the tests in $tmp"
  fi
fi
exit $status
