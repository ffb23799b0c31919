// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command injector is an NRI plugin of the end-to-end tests: like
// containerd's device-injector sample, it adds to a container the device
// node an annotation of the container names, and it registers with an
// index above the guard's, so that it adjusts containers after the guard's
// CreateContainer. It prints "injector: saw <container name>" for every
// container it is asked about, which tells the test it is registered.
//
//	injector -socket PATH -idx 95 -annotation KEY
//
// The annotation's value is "PATH:MAJOR:MINOR" (a character device). With
// -unset-annotation KEY2, a container annotated KEY2=NAME has its env
// variable NAME removed instead; with -set-annotation KEY3, one annotated
// KEY3=NAME=VALUE has NAME set to VALUE.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

type injector struct{ key, unsetKey, setKey string }

func (in injector) CreateContainer(_ context.Context, _ *api.PodSandbox, c *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	fmt.Printf("injector: saw %s\n", c.GetName())
	if name, ok := c.GetAnnotations()[in.unsetKey]; ok && in.unsetKey != "" {
		// As a plugin that strips a variable from the containers it
		// adjusts (NVIDIA_VISIBLE_DEVICES of a CUDA image, say).
		adj := &api.ContainerAdjustment{}
		adj.RemoveEnv(name)
		fmt.Printf("injector: removed env %s of %s\n", name, c.GetName())
		return adj, nil, nil
	}
	if kv, ok := c.GetAnnotations()[in.setKey]; ok && in.setKey != "" {
		// As a plugin that rewrites a variable (a device selector, say).
		name, val, found := strings.Cut(kv, "=")
		if !found {
			return nil, nil, fmt.Errorf("injector: annotation %s=%q: want NAME=VALUE", in.setKey, kv)
		}
		adj := &api.ContainerAdjustment{}
		adj.AddEnv(name, val)
		fmt.Printf("injector: set env %s=%s of %s\n", name, val, c.GetName())
		return adj, nil, nil
	}
	v, ok := c.GetAnnotations()[in.key]
	if !ok {
		return nil, nil, nil
	}
	parts := strings.Split(v, ":")
	if len(parts) != 3 {
		return nil, nil, fmt.Errorf("injector: annotation %s=%q: want PATH:MAJOR:MINOR", in.key, v)
	}
	major, err1 := strconv.ParseInt(parts[1], 10, 64)
	minor, err2 := strconv.ParseInt(parts[2], 10, 64)
	if err1 != nil || err2 != nil {
		return nil, nil, fmt.Errorf("injector: annotation %s=%q: want PATH:MAJOR:MINOR", in.key, v)
	}
	adj := &api.ContainerAdjustment{}
	adj.AddDevice(&api.LinuxDevice{Path: parts[0], Type: "c", Major: major, Minor: minor})
	fmt.Printf("injector: added %s (%d:%d) to %s\n", parts[0], major, minor, c.GetName())
	return adj, nil, nil
}

func main() {
	socket := flag.String("socket", "", "the runtime's NRI socket")
	idx := flag.String("idx", "95", "plugin index")
	key := flag.String("annotation", "", "the annotation naming the device to add")
	unsetKey := flag.String("unset-annotation", "", "the annotation naming an env variable to remove")
	setKey := flag.String("set-annotation", "", "the annotation naming NAME=VALUE to set in the env")
	flag.Parse()
	s, err := stub.New(injector{key: *key, unsetKey: *unsetKey, setKey: *setKey}, stub.WithPluginName("injector"), stub.WithPluginIdx(*idx), stub.WithSocketPath(*socket))
	if err != nil {
		fmt.Fprintln(os.Stderr, "injector:", err)
		os.Exit(1)
	}
	if err := s.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "injector:", err)
		os.Exit(1)
	}
}
