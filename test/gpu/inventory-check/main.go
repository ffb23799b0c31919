// Command inventory-check verifies, on a real GPU host, that the guard's NVML
// inventory agrees with nvidia-smi: the index, UUID, minor number and PCI bus
// id of every GPU, the MIG instances and their <gpu>:<mig> indices, that the
// /proc/driver/nvidia inventory (index = PCI bus order) agrees with NVML, and
// that the resolver maps "0", the first UUID, "all", every /dev/nvidia<minor>
// and every MIG id to the right UUIDs. It prints what it compared and exits 1
// on any mismatch, so a wrong assumption about a driver fails loudly.
package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
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
