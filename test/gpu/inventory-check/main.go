// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command inventory-check verifies, on a real GPU host, that the guard's NVML
// inventory agrees with nvidia-smi: the index, UUID, minor number and PCI bus
// id of every GPU, the MIG instances and their <gpu>:<mig> indices, that the
// /proc/driver/nvidia inventory (index = PCI bus order) agrees with NVML, and
// that the resolver maps "0", the first UUID, "all", every /dev/nvidia<minor>
// and every MIG id to the right UUIDs. It prints what it compared and exits 1
// on any mismatch, so a wrong assumption about a driver fails loudly.
//
// It then shows the processes and the health of every device as the guard's
// observer sees them (pkg/observe: NVML process lists mapped to containers
// through /proc, lost devices, critical Xid events for a few seconds) and
// checks the processes against nvidia-smi --query-compute-apps.
package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

func main() {
	c := &checker{}
	c.run()
	if c.failures > 0 {
		fmt.Fprintf(os.Stderr, "inventory-check: FAILED: %d mismatch(es)\n", c.failures)
		os.Exit(1)
	}
	fmt.Println("inventory-check: OK")
}

type checker struct {
	failures int
}

func (c *checker) fail(format string, args ...any) {
	c.failures++
	fmt.Fprintf(os.Stderr, "MISMATCH: "+format+"\n", args...)
}

func (c *checker) ok(format string, args ...any) {
	fmt.Printf("ok: "+format+"\n", args...)
}

// smiGPU is one GPU as nvidia-smi reports it.
type smiGPU struct {
	index int
	uuid  string
	minor string // "[N/A]" on platforms without device minors
	bus   string
	migs  []smiMIG
}

type smiMIG struct {
	device int // "Device N" in nvidia-smi -L: the MIG index on the GPU
	uuid   string
}

func (c *checker) run() {
	gpus, err := nvmlloader.New(nil).Load()
	if err != nil {
		c.fail("load the NVML inventory: %v", err)
		return
	}
	inv, err := devices.NewInventory("nvml", gpus)
	if err != nil {
		c.fail("the NVML inventory is inconsistent: %v", err)
		return
	}
	c.ok("NVML inventory: %d GPU(s)", len(inv.GPUs))

	smi, err := nvidiaSMI()
	if err != nil {
		c.fail("run nvidia-smi: %v", err)
		return
	}
	c.compareGPUs(inv, smi)
	c.compareProc(inv)
	c.checkResolver(inv, smi)
	c.checkObserver(inv)
}

func nvidiaSMI() ([]smiGPU, error) {
	query, err := command("nvidia-smi", "--query-gpu=index,uuid,minor_number,pci.bus_id", "--format=csv,noheader")
	if err != nil {
		return nil, err
	}
	list, err := command("nvidia-smi", "-L")
	if err != nil {
		return nil, err
	}
	return parseSMI(query, list)
}

var (
	gpuLine = regexp.MustCompile(`^GPU (\d+): .*\(UUID: (GPU-[^)]+)\)`)
	migLine = regexp.MustCompile(`^\s+MIG .*Device\s+(\d+): \(UUID: (MIG-[^)]+)\)`)
)

// parseSMI reads the output of nvidia-smi --query-gpu=index,uuid,minor_number,pci.bus_id
// --format=csv,noheader and of nvidia-smi -L.
func parseSMI(query, list string) ([]smiGPU, error) {
	var gpus []smiGPU
	for _, line := range lines(query) {
		f := strings.Split(line, ",")
		if len(f) != 4 {
			return nil, fmt.Errorf("unexpected nvidia-smi --query-gpu line %q", line)
		}
		idx, err := strconv.Atoi(strings.TrimSpace(f[0]))
		if err != nil {
			return nil, fmt.Errorf("unexpected index in %q", line)
		}
		gpus = append(gpus, smiGPU{index: idx, uuid: strings.TrimSpace(f[1]), minor: strings.TrimSpace(f[2]), bus: strings.TrimSpace(f[3])})
	}
	cur := -1
	for _, line := range lines(list) {
		if m := gpuLine.FindStringSubmatch(line); m != nil {
			idx, _ := strconv.Atoi(m[1])
			cur = -1
			for i := range gpus {
				if gpus[i].index == idx {
					cur = i
					if gpus[i].uuid != m[2] {
						return nil, fmt.Errorf("nvidia-smi -L and --query-gpu disagree on GPU %d: %s vs %s", idx, m[2], gpus[i].uuid)
					}
				}
			}
			continue
		}
		if m := migLine.FindStringSubmatch(line); m != nil && cur >= 0 {
			dev, _ := strconv.Atoi(m[1])
			gpus[cur].migs = append(gpus[cur].migs, smiMIG{device: dev, uuid: m[2]})
		}
	}
	return gpus, nil
}

func command(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out.String(), nil
}

func lines(s string) []string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) != "" {
			out = append(out, sc.Text())
		}
	}
	return out
}

func (c *checker) compareGPUs(inv *devices.Inventory, smi []smiGPU) {
	if len(smi) != len(inv.GPUs) {
		c.fail("nvidia-smi lists %d GPU(s), the NVML inventory %d", len(smi), len(inv.GPUs))
	}
	for _, s := range smi {
		d, found := inv.ByIndex(strconv.Itoa(s.index))
		if !found {
			c.fail("GPU %d (%s) from nvidia-smi is not in the inventory", s.index, s.uuid)
			continue
		}
		g, _ := inv.GPUOf(d.UUID)
		if g.UUID != s.uuid {
			c.fail("GPU %d: inventory UUID %s, nvidia-smi %s", s.index, g.UUID, s.uuid)
		}
		if s.minor == "[N/A]" {
			fmt.Printf("note: GPU %d: nvidia-smi shows no minor number\n", s.index)
		} else if m, err := strconv.Atoi(s.minor); err != nil || m != g.Minor {
			c.fail("GPU %d (%s): inventory minor %d, nvidia-smi %q", s.index, g.UUID, g.Minor, s.minor)
		}
		if g.BusID != "" && busKey(s.bus) != busKey(g.BusID) {
			c.fail("GPU %d (%s): inventory bus id %s, nvidia-smi %s", s.index, g.UUID, g.BusID, s.bus)
		}
		c.compareMIG(g, s)
		c.ok("GPU %d %s minor %d bus %s, %d MIG instance(s)", s.index, g.UUID, g.Minor, g.BusID, len(g.MIG))
	}
}

// busKey reads "dddd:bb:dd.f" with any domain width ("00000000:3B:00.0" from
// nvidia-smi, "0000:3b:00.0" in the inventory) as numbers.
func busKey(s string) [4]uint64 {
	var k [4]uint64
	f := strings.FieldsFunc(s, func(r rune) bool { return r == ':' || r == '.' })
	for i := 0; i < len(f) && i < 4; i++ {
		k[i], _ = strconv.ParseUint(f[i], 16, 64)
	}
	return k
}

func (c *checker) compareMIG(g devices.GPU, s smiGPU) {
	if len(g.MIG) != len(s.migs) {
		c.fail("GPU %d: inventory has %d MIG instance(s), nvidia-smi -L %d", g.Index, len(g.MIG), len(s.migs))
	}
	byUUID := map[string]devices.MIG{}
	for _, m := range g.MIG {
		byUUID[m.UUID] = m
	}
	for _, sm := range s.migs {
		m, ok := byUUID[sm.uuid]
		if !ok {
			c.fail("GPU %d: MIG %s (Device %d in nvidia-smi -L) is not in the inventory", g.Index, sm.uuid, sm.device)
			continue
		}
		if m.Index != sm.device {
			c.fail("MIG %s: inventory index %d:%d, nvidia-smi -L Device %d", sm.uuid, g.Index, m.Index, sm.device)
		}
	}
}

// compareProc checks the /proc loader's central assumption: PCI bus order is
// NVML's index order.
func (c *checker) compareProc(inv *devices.Inventory) {
	if _, err := os.Stat("/proc/driver/nvidia/gpus"); err != nil {
		fmt.Printf("note: no /proc/driver/nvidia/gpus (%v): proc loader not compared\n", err)
		return
	}
	proc, err := devices.NewProcLoader("/").Load()
	if err != nil {
		c.fail("proc loader: %v", err)
		return
	}
	if len(proc) != len(inv.GPUs) {
		c.fail("proc loader lists %d GPU(s), NVML %d", len(proc), len(inv.GPUs))
	}
	for i, p := range proc {
		if i >= len(inv.GPUs) {
			break
		}
		n := inv.GPUs[i]
		if p.Index != n.Index || p.UUID != n.UUID || p.Minor != n.Minor {
			c.fail("proc loader GPU %d (%s, minor %d) differs from NVML GPU %d (%s, minor %d)", p.Index, p.UUID, p.Minor, n.Index, n.UUID, n.Minor)
		}
	}
	c.ok("proc loader agrees with NVML on index, UUID and minor of %d GPU(s)", len(proc))
}

func (c *checker) checkResolver(inv *devices.Inventory, smi []smiGPU) {
	if len(smi) == 0 {
		c.fail("no GPU to resolve")
		return
	}
	r := devices.NewResolver(inv, config.Default().Policy)
	expect := func(what string, req devices.Request, want ...string) {
		res, err := r.Resolve(req)
		if err != nil {
			c.fail("resolve %s: %v", what, err)
			return
		}
		sort.Strings(want)
		if got := res.UUIDs(); strings.Join(got, ",") != strings.Join(want, ",") {
			c.fail("resolve %s: got %v, want %v", what, got, want)
			return
		}
		c.ok("resolve %s -> %v", what, want)
	}
	env := func(v string) devices.Request {
		return devices.Request{Env: []string{devices.EnvVisibleDevices + "=" + v}}
	}
	first := smi[0]
	for _, s := range smi {
		if s.index < first.index {
			first = s
		}
	}
	var zero string
	var all []string
	for _, s := range smi {
		all = append(all, s.uuid)
		if s.index == 0 {
			zero = s.uuid
		}
	}
	if zero != "" {
		expect(`NVIDIA_VISIBLE_DEVICES="0"`, env("0"), zero)
	}
	expect(fmt.Sprintf("NVIDIA_VISIBLE_DEVICES=%q", first.uuid), env(first.uuid), first.uuid)
	expect(`NVIDIA_VISIBLE_DEVICES="all"`, env("all"), all...)
	for _, s := range smi {
		if m, err := strconv.Atoi(s.minor); err == nil {
			path := fmt.Sprintf("/dev/nvidia%d", m)
			// On a MIG-enabled GPU too: the parent node alone is a whole-GPU claim.
			expect("device "+path, devices.Request{Devices: []devices.LinuxDevice{{Path: path, Type: "c", Major: 195, Minor: int64(m)}}}, s.uuid)
		}
		for _, mg := range s.migs {
			expect(fmt.Sprintf("NVIDIA_VISIBLE_DEVICES=%q", mg.uuid), env(mg.uuid), mg.uuid)
			expect(fmt.Sprintf(`NVIDIA_VISIBLE_DEVICES="%d:%d"`, s.index, mg.device), env(fmt.Sprintf("%d:%d", s.index, mg.device)), mg.uuid)
		}
	}
}

// computeApp is one line of nvidia-smi --query-compute-apps.
type computeApp struct {
	pid  int
	uuid string // the GPU's UUID (a MIG process is listed under its GPU)
	mem  string
}

// parseComputeApps reads nvidia-smi
// --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader.
func parseComputeApps(out string) ([]computeApp, error) {
	var apps []computeApp
	for _, line := range lines(out) {
		if strings.Contains(line, "No running") {
			continue
		}
		f := strings.Split(line, ",")
		if len(f) != 3 {
			return nil, fmt.Errorf("unexpected nvidia-smi --query-compute-apps line %q", line)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(f[0]))
		if err != nil {
			return nil, fmt.Errorf("unexpected pid in %q", line)
		}
		apps = append(apps, computeApp{pid: pid, uuid: strings.TrimSpace(f[1]), mem: strings.TrimSpace(f[2])})
	}
	return apps, nil
}

// seen is what the observer passes listed: pid → device UUIDs, a MIG
// instance's process under both the instance and its GPU (nvidia-smi names
// the GPU).
type seen map[int]map[string]bool

func (s seen) add(pid int, gpu string) {
	if s[pid] == nil {
		s[pid] = map[string]bool{}
	}
	s[pid][gpu] = true
}

func (c *checker) checkObserver(inv *devices.Inventory) {
	src, err := observe.OpenNVML(nil)
	if err != nil {
		c.fail("observer: %v", err)
		return
	}
	defer func() { _ = src.Close() }()
	var logs strings.Builder
	o, err := observe.New(observe.Options{
		Source: src, GPUs: inv.GPUs, ProcRoot: "/", Xids: config.DefaultXids(),
		// A read-only check: with no claims every process is listed as
		// not admitted; what matters here is what NVML and /proc show.
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return nil, nil }),
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		c.fail("observer: %v", err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Processes come and go: a pid nvidia-smi lists must be in one of the
	// observer's passes before or after it.
	first, err := o.Account(ctx)
	if err != nil {
		c.fail("observer: accounting pass: %v", err)
		return
	}
	out, err := command("nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader")
	if err != nil {
		c.fail("%v", err)
		return
	}
	apps, err := parseComputeApps(out)
	if err != nil {
		c.fail("%v", err)
		return
	}
	second, err := o.Account(ctx)
	if err != nil {
		c.fail("observer: accounting pass: %v", err)
		return
	}
	s := seen{}
	for _, r := range []observe.Report{first, second} {
		for _, d := range r.Devices {
			for _, p := range d.Processes {
				s.add(p.PID, d.Device.UUID)
				if d.Device.IsMIG() {
					s.add(p.PID, d.Device.ParentUUID)
				}
			}
		}
	}
	fmt.Println("observer: processes (second pass):")
	for _, d := range second.Devices {
		if d.Error != "" {
			fmt.Printf("  %s: ERROR %s\n", d.Device, d.Error)
			continue
		}
		if len(d.Processes) == 0 {
			fmt.Printf("  %s: no processes\n", d.Device)
		}
		for _, p := range d.Processes {
			owner := "host"
			switch {
			case p.Gone:
				owner = "gone"
			case p.ContainerID != "":
				owner = "container " + p.ContainerID
			}
			fmt.Printf("  %s: pid %d type %s %d MiB %s\n", d.Device, p.PID, p.Type, p.UsedMemoryBytes>>20, owner)
		}
	}
	for _, a := range apps {
		if !s[a.pid][a.uuid] {
			c.fail("nvidia-smi lists compute pid %d on %s (%s); the observer saw it in neither pass", a.pid, a.uuid, a.mem)
			continue
		}
		c.ok("observer and nvidia-smi agree: pid %d on %s", a.pid, a.uuid)
	}
	c.ok("observer: %d compute process(es) in nvidia-smi, all seen", len(apps))

	// Health: lost devices from the passes, then critical Xid events for a
	// few seconds (NVML delivers only new events: none is expected).
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Second)
	o.Run(wctx)
	wcancel()
	if strings.Contains(logs.String(), "not watched") || strings.Contains(logs.String(), "failed") {
		fmt.Printf("note: observer health watcher:\n%s", logs.String())
	}
	unhealthy := o.Unhealthy()
	for _, f := range unhealthy {
		c.fail("observer: %s", f.Message)
	}
	if len(unhealthy) == 0 {
		c.ok("observer: every device healthy (no device lost, no critical Xid in %s)", 3*time.Second)
	}
}
