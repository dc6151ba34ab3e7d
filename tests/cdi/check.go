// cdi-check reads a CDI spec directory with the CDI library itself, as containerd and CRI-O do,
// and injects devices into a container's OCI spec the way those runtimes do at container creation.
//
//	cdi-check SPEC_DIR [KIND=DEVICE ...]
//
// Standard input: a JSON array of the container's own environment ("NAME=value"). Prints one JSON
// document: the spec files the library found, every error it reported (its schema check included),
// and for each requested device the container's resulting environment and mounts. Exit 0 when the
// document was printed, 2 on a usage error.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"
	"github.com/container-orchestrated-devices/container-device-interface/pkg/cdi/validate"
	oci "github.com/opencontainers/runtime-spec/specs-go"
)

type mount struct {
	Source      string   `json:"source"`
	Destination string   `json:"destination"`
	Type        string   `json:"type"`
	Options     []string `json:"options"`
}

type injected struct {
	Error  string   `json:"error,omitempty"`
	Env    []string `json:"env"`
	Mounts []mount  `json:"mounts"`
}

type report struct {
	Devices  []string            `json:"devices"`
	Errors   map[string][]string `json:"errors"`
	Injected map[string]injected `json:"injected"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdi-check SPEC_DIR [KIND=DEVICE ...] < container-env.json")
		os.Exit(2)
	}
	var baseEnv []string
	if err := json.NewDecoder(os.Stdin).Decode(&baseEnv); err != nil {
		fmt.Fprintln(os.Stderr, "cdi-check: standard input is not a JSON array of NAME=value:", err)
		os.Exit(2)
	}
	// The schema check the runtimes can enable, on top of the library's own rules.
	cdi.SetSpecValidator(validate.WithDefaultSchema())
	cache, err := cdi.NewCache(cdi.WithSpecDirs(os.Args[1]), cdi.WithAutoRefresh(false))
	out := report{Errors: map[string][]string{}, Injected: map[string]injected{}}
	if err != nil {
		out.Errors["cache"] = []string{err.Error()}
	}
	if cache != nil {
		out.Devices = cache.ListDevices()
		for path, errs := range cache.GetErrors() {
			for _, e := range errs {
				out.Errors[path] = append(out.Errors[path], e.Error())
			}
		}
		for _, device := range os.Args[2:] {
			spec := &oci.Spec{Process: &oci.Process{Env: append([]string(nil), baseEnv...)}}
			result := injected{}
			if _, err := cache.InjectDevices(spec, device); err != nil {
				result.Error = err.Error()
			}
			result.Env = spec.Process.Env
			for _, m := range spec.Mounts {
				result.Mounts = append(result.Mounts, mount{m.Source, m.Destination, m.Type, m.Options})
			}
			out.Injected[device] = result
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		os.Exit(1)
	}
}
