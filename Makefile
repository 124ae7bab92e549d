# tether: the two commands a fresh machine needs are `make run` and `make test`.
GO      ?= go
BIN     := bin
LISTEN  ?= 127.0.0.1:8080
DEMO    ?= 4
FUZZTIME ?= 30s

PREFIX  ?= /usr/local
DESTDIR ?=

.PHONY: all build run test vet check-generate generate bench soak fuzz clean install deb vmtest

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...

# Run tetherd on the embedded default: DEMO built-in session workers on
# loopback, the data plane on LISTEN.
run: build
	./$(BIN)/tetherd --demo $(DEMO) --listen $(LISTEN)

# Everything CI runs (.ci/run calls exactly this). Tests that need root or
# BPF run when root (CI is root) and otherwise skip loudly.
test: vet check-generate
	$(GO) test -race -count=1 -timeout 20m ./...
	# the event loops' path without io_uring (system calls one by one)
	$(GO) test -race -count=1 -timeout 10m ./userspace/proxy/ -args -syscalls
	@$(MAKE) --no-print-directory fuzz FUZZTIME=$(FUZZTIME_CI)

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	@# imports in three groups: standard library, third-party, this module's
	$(GO) run ./tools/importgroups $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './.*')
	@# no file under userspace/ over 600 lines (tests and generated files aside)
	$(GO) run ./tools/filelines -max 600 userspace
	@# the README's and docs/operations.md's flag tables are tetherd -h
	$(GO) run ./tools/flagdoc -check README.md docs/operations.md
	$(GO) vet ./...

# Regenerate the committed bpf2go output (needs clang, libbpf-dev).
generate:
	$(GO) generate ./bpf

# Where clang is present, the committed BPF object must match its source.
check-generate:
	@if command -v clang >/dev/null 2>&1 && [ -f /usr/include/bpf/bpf_helpers.h ]; then \
		$(GO) generate ./bpf && git diff --exit-code --stat -- bpf/ \
		|| { echo "bpf/: committed bpf2go output is stale: run 'make generate' and commit"; exit 1; }; \
	else echo "check-generate: clang or libbpf-dev missing, not checking bpf/ output"; fi

# Benchmarks against a direct backend, nginx and HAProxy in one run.
BENCHFLAGS ?=
bench:
	$(GO) run ./cmd/tether-bench $(BENCHFLAGS)

# Overload and fault scenarios (slowloris, 10,000 idle connections, slow
# readers, 8 GiB up and down, a descriptor limit) on tetherd and nginx,
# with figures: bench/soak-latest.md.
SOAKFLAGS ?=
soak:
	$(GO) run ./cmd/tether-bench -phases soak -only tetherd,nginx -out bench/soak-latest.md $(SOAKFLAGS)

# Every fuzz target in the tree (found by name, so a new one is never left
# out), FUZZTIME each. `make test` runs them for FUZZTIME_CI each; a crash
# leaves its input in the package's testdata/fuzz/<Target>/: commit it, and
# it runs as a regression case in every `go test` from then on.
FUZZTIME_CI ?= 3s
# Go 1.26's fuzzing coordinator can fail a target with a bare "context
# deadline exceeded" at the end of its -fuzztime on a loaded machine
# (golang/go#75804, fixed in Go 1.27): such a failure, with no failing
# input written, is run once more; any other failure stops here.
fuzz:
	@set -e; log=$$(mktemp); trap 'rm -f $$log' EXIT; \
	for f in $$(grep -rl --include='*_test.go' '^func Fuzz' userspace cmd testenv); do \
		for t in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
			echo "fuzz ./$$(dirname $$f) $$t for $(FUZZTIME)"; \
			if ! $(GO) test -run '^$$' -fuzz "^$$t\$$" -fuzztime $(FUZZTIME) ./$$(dirname $$f) >$$log 2>&1; then \
				cat $$log; \
				if grep -q 'context deadline exceeded' $$log && ! grep -q 'Failing input written' $$log; then \
					echo "fuzz: $$t: the coordinator missed its own deadline (golang/go#75804): once more"; \
					$(GO) test -run '^$$' -fuzz "^$$t\$$" -fuzztime $(FUZZTIME) ./$$(dirname $$f); \
				else exit 1; fi; \
			else tail -n 3 $$log; fi; \
		done; \
	done

# Binaries, the systemd unit and the docs; a config file only if none is
# there. Then: systemctl daemon-reload && systemctl enable --now tetherd.
install: build
	install -D -m 0755 $(BIN)/tetherd $(DESTDIR)$(PREFIX)/bin/tetherd
	install -D -m 0755 $(BIN)/tetherctl $(DESTDIR)$(PREFIX)/bin/tetherctl
	install -D -m 0755 $(BIN)/tether-demo $(DESTDIR)$(PREFIX)/bin/tether-demo
	install -d $(DESTDIR)/etc/systemd/system
	sed 's|/usr/local|$(PREFIX)|g' cmd/tetherd/tetherd.service > $(DESTDIR)/etc/systemd/system/tetherd.service
	install -D -m 0644 docs/operations.md $(DESTDIR)$(PREFIX)/share/doc/tether/operations.md
	test -e $(DESTDIR)/etc/tether/tetherd.json || install -D -m 0644 cmd/tetherd/tetherd.example.json $(DESTDIR)/etc/tether/tetherd.json
	@echo "installed. Start: systemctl daemon-reload && systemctl enable --now tetherd; upgrade in place: tetherctl upgrade"

# A Debian package (dpkg-deb): tetherd, tetherctl, tether-demo, the unit,
# /etc/tether/tetherd.json, docs. Written to $(BIN)/tether_<version>_<arch>.deb.
deb:
	packaging/deb/build.sh $(BIN)

# The kernel-level tests on real kernels (Debian's 5.10, 6.1, 6.12) in qemu,
# and on VMTEST_SYSTEMD's boot the .deb under systemd as PID 1
# (testenv/systemd-e2e.sh). Needs root, qemu-system-x86, debootstrap; the
# root filesystem and kernels are cached in .vmcache/. See docs/vmtest.md.
VMTEST_KERNELS ?= 5.10 6.1 6.12
VMTEST_SYSTEMD ?= 6.1
vmtest:
	VM_KERNELS="$(VMTEST_KERNELS)" VM_SYSTEMD="$(VMTEST_SYSTEMD)" GO="$(GO)" testenv/vm/vmtest.sh

clean:
	rm -rf $(BIN)

# The RL figures: rollout workloads (GRPO groups, agent sessions,
# skewed contexts) on 8 fake engines through tetherd, by routing mode
# (cmd/tether-rlsim; about 5 minutes). RLSIM_FLAGS: more flags.
RLSIM_FLAGS ?=
.PHONY: rlsim
rlsim:
	$(GO) run ./cmd/tether-rlsim $(RLSIM_FLAGS)

# Placement from the engines' KV events (docs/routing.md, "Placement from
# the engines' KV events"): GRPO groups, keyless agent sessions and skewed
# keyed sessions on 8 fake engines whose prefill is 200µs a token,
# tetherd with --kv-events against a random engine and plain hashing,
# with each engine's figures and the workloads' bounds (about 8
# minutes). RLSIM_FLAGS: more flags (-engine vllm, -engines, -block-tokens,
# -kv-form, -seed, the length flags).
.PHONY: rlsim-kv
rlsim-kv:
	$(GO) run ./cmd/tether-rlsim -prefill-per-token 200us -modes kv,hash,random \
		-workload grpo,keyless,skewed,restart -per-engine $(RLSIM_FLAGS)

# The P/D figures (docs/pd.md): GRPO and agent load on a fake fleet of 2
# prefill + 6 decode engines of each engine, through tetherd and by a
# direct P/D client at once, the same fleet without P/D, and a weight
# sync under load (cmd/tether-rlsim -pd; about 10 minutes).
.PHONY: rlsim-pd
rlsim-pd:
	$(GO) run ./cmd/tether-rlsim -pd sglang,vllm -workload grpo,sessions,keyless $(RLSIM_FLAGS)
