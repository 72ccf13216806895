#!/usr/bin/env bash
# Prints the dependency edges between gateway/src's top-level modules
# (from `crate::<module>` paths in code and doc comments, whose links are
# dependencies too; plain comments ignored) and fails on an
# edge that points up or sideways in the layer order below, on a cycle, or
# on an HTTP transport crate used below the http layer. No cargo needed.
#
#   scripts/check-layers.sh            # edges + verdict, exit 1 on a violation
#   SRC=path/to/gateway/src scripts/check-layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${SRC:-gateway/src}

# Layer of each top-level module: a module may use only modules of a lower
# layer. Equal layers are siblings and must not use each other. A module
# missing here fails the check (add it deliberately).
RANKS='util=0 auth=1 mlx=1 upstream=1 limits=1 engine=2 policy=2 datasets=3 jobs=4 fixtures=4 config=5 app=6 http=7 cli=8'

edges=$(
  grep -rnE --include='*.rs' '\bcrate::[a-z_]+' "$SRC" \
  | grep -vE '^[^:]+:[0-9]+:[[:space:]]*//([^/!]|$)' \
  | awk -v src="$SRC/" '
      {
        file = substr($0, 1, index($0, ":") - 1); sub("^" src, "", file)
        if (file == "lib.rs" || file == "main.rs") next
        from = file; sub(/\/.*/, "", from); sub(/\.rs$/, "", from)
        line = $0
        while (match(line, /crate::[a-z_]+/)) {
          to = substr(line, RSTART + 7, RLENGTH - 7)
          if (to != from) print from, to
          line = substr(line, RSTART + RLENGTH)
        }
      }' \
  | sort | uniq -c | awk '{print $2, $3, $1}'
)

status=0
echo "== top-level module edges (from -> to: references)"
echo "$edges" | awk 'NF { printf "  %-9s -> %-9s %4d\n", $1, $2, $3 }'

echo "== layer order: $RANKS"
bad=$(echo "$edges" | awk -v ranks="$RANKS" '
  BEGIN { n = split(ranks, kv, " "); for (i = 1; i <= n; i++) { split(kv[i], p, "="); r[p[1]] = p[2] } }
  NF {
    if (!($1 in r)) { print "  unranked module: " $1; next }
    if (!($2 in r)) { print "  unranked module: " $2; next }
    if (r[$1] <= r[$2]) printf "  FORBIDDEN %s (layer %d) -> %s (layer %d)\n", $1, r[$1], $2, r[$2]
  }' | sort -u)
if [ -n "$bad" ]; then echo "$bad"; status=1; fi

# Cycles, whatever the ranks say (tsort names a loop on stderr).
loops=$(echo "$edges" | awk 'NF { print $2, $1 }' | tsort 2>&1 >/dev/null || true)
if echo "$loops" | grep -qE 'loop|cycle'; then
  echo "== cycle between top-level modules:"; echo "$loops" | sed 's/^/  /'; status=1
fi

# Below the http layer nothing speaks HTTP: no server or client crates.
# Files still allowed to (none now: the CLI clients live in cli/, above http).
TRANSPORT_ALLOW=${TRANSPORT_ALLOW-}
transport=$(grep -rnE --include='*.rs' '^[[:space:]]*(pub )?use (hyper|hyper_util|http_body_util)(::|;)|^[[:space:]]*(pub )?use http::|\bhyper::|tokio::net::' \
  "$SRC/config.rs" "$SRC/app" "$SRC/engine" "$SRC/policy" "$SRC/jobs" "$SRC/mlx" 2>/dev/null || true)
for f in $TRANSPORT_ALLOW; do transport=$(echo "$transport" | grep -v "^$SRC/$f:" || true); done
if [ -n "$transport" ]; then
  echo "== HTTP transport below the http layer:"; echo "$transport" | sed 's/^/  /'; status=1
fi

[ "$status" = 0 ] && echo "OK: layers hold" || echo "FAILED: see above"
exit "$status"
