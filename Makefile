# nri-gpu-guard — build, test and demo targets. Every target works on a fresh
# Debian machine with Go; `make demo` and `make integration` need root.

GO          ?= go
PKG         := github.com/nri-gpu-guard/nri-gpu-guard
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT      ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS     := -s -w -X $(PKG)/pkg/version.Version=$(VERSION) -X $(PKG)/pkg/version.Commit=$(COMMIT)
# go-nvml's cgo prologue warns about NVML functions deprecated upstream; they
# are not called, so keep the build output readable.
export CGO_ENABLED ?= 1
export CGO_CFLAGS  ?= -O2 -Wno-deprecated-declarations
# The wasm plugin runtime of containerd/nri is not used by this project.
TAGS        := nri_no_wasm
BIN         := bin
# The hook relay (cmd/nri-gpu-guard-hook-relay/relay.c): plain C, static, so
# that a runtime's hook costs no language runtime start. Built with musl
# (musl-gcc, Debian's musl-tools) where it is installed: a static glibc
# program's own start (CPU feature probing with cpuid, ifunc relocations,
# some 25 page faults) took 1.0-1.7 ms of CPU per run on a VM, a static musl
# one 0.2 ms (docs/benchmarks.md); otherwise with $(CC) (make's, cc unless
# set). The tests build it the same way (RELAY_CC, else musl-gcc, else cc).
RELAY_CC     ?= $(or $(shell command -v musl-gcc 2>/dev/null),$(CC))
RELAY_CFLAGS ?= -O2 -static -Wall -Wextra -Werror
# `make fuzz` (CI): per-target call counts from hack/fuzz-budgets.txt, which
# have no wall-clock deadline. `make fuzz FUZZTIME=5m` explores by duration.
FUZZTIME    ?= ci
TOOLS_DIR   ?= $(HOME)/.cache/nri-gpu-guard/tools
GOLANGCI    := $(TOOLS_DIR)/golangci-lint
# The containerd release the end-to-end suite runs against (empty: setup.sh's
# default), e.g. `make integration CONTAINERD_VERSION=v1.7.35`.
CONTAINERD_VERSION ?=
export CONTAINERD_VERSION
# Releases `make matrix` runs the core subset on (empty: the newest patch of
# every supported line, see test/integration/matrix.sh); MATRIX_CHECK=README.md
# also checks the README's compatibility table against the runs.
MATRIX_VERSIONS ?=
export MATRIX_CHECK
# CGROUP=v2 runs the end-to-end suite on cgroup v2 on a cgroup v1 or hybrid
# host (a private mount namespace with the unified hierarchy at
# /sys/fs/cgroup, see test/integration/cgroup2.sh).
CGROUP      ?=
E2E_WRAP    := $(if $(filter v2,$(CGROUP)),./test/integration/cgroup2.sh)
export E2E_WRAP

.PHONY: all build test race fuzz lint bench bench-process integration integration-podman matrix demo gpu-check package clean tools

all: build

# The daemon links NVML (cgo). The OCI hook binary starts once per container
# and phase, gpu-guard-ctl once per operator command: both static, no cgo;
# gpu-guard-ctl hands the commands that need NVML to `nri-gpu-guard ctl`.
# The hook relay forwards a hook run to `nri-gpu-guard-hook serve` and execs
# the hook binary whenever that server cannot answer.
build:
	$(GO) build -tags $(TAGS) -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/nri-gpu-guard
	CGO_ENABLED=0 $(GO) build -tags $(TAGS) -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/nri-gpu-guard-hook ./cmd/gpu-guard-ctl
	$(RELAY_CC) $(RELAY_CFLAGS) -o $(BIN)/nri-gpu-guard-hook-relay cmd/nri-gpu-guard-hook-relay/relay.c

# The real-runc tests of pkg/hook run twice: as part of ./..., and with every
# container's hooks through nri-gpu-guard-hook-relay and a hook server
# (NRI_GPU_GUARD_TEST_RELAY), which must give the same verdicts.
RUNC_SUITE := TestRunc|TestHookBurst|TestHookWaiterLeavesQueue|TestDeadWaiterDoesNotBlockFreedGPU|TestTicketHandover|TestCrun

test:
	$(GO) vet -tags $(TAGS) ./...
	$(GO) test -tags $(TAGS) -race -count=1 ./...
	NRI_GPU_GUARD_TEST_RELAY=1 $(GO) test -tags $(TAGS) -count=1 -run '$(RUNC_SUITE)' ./pkg/hook/

fuzz:
	./hack/fuzz.sh $(FUZZTIME)

bench:
	$(GO) test -tags $(TAGS) -run '^$$' -bench . -benchmem ./pkg/...

# Whole processes, interleaved A/B against their floors: the hook binary, runc
# with the hooks (root and runc), gpu-guard-ctl status/queue. Prints a table.
bench-process:
	./hack/bench-process.sh

$(GOLANGCI):
	GOBIN=$(TOOLS_DIR) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0

lint: $(GOLANGCI)
	./hack/check-license.sh
	test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GOLANGCI) run --build-tags $(TAGS) ./...
	$(GOLANGCI) run --build-tags '$(TAGS) integration' ./test/...
	$(GOLANGCI) run --build-tags '$(TAGS) podman' ./test/...

integration: build
	./test/integration/setup.sh
	$(E2E_WRAP) $(GO) test -tags '$(TAGS) integration' -count=1 -v -timeout 15m ./test/integration/...

matrix: build
	./test/integration/matrix.sh $(MATRIX_VERSIONS)

# The OCI hook on real podman with runc and crun (needs root; installs podman,
# conmon, runc and crun from the distribution when missing): every scenario
# with the hooks run directly (TestPodman) and through the relay and the hook
# server (TestPodmanRelay).
integration-podman: build
	./test/integration/setup-podman.sh
	$(GO) test -tags '$(TAGS) podman' -count=1 -v -timeout 20m -run TestPodman ./test/integration/

demo: build
	./test/integration/setup.sh
	./hack/demo.sh

gpu-check: build
	./test/gpu/gpu-check.sh

package: build
	./packaging/build-packages.sh

clean:
	rm -rf $(BIN) dist
