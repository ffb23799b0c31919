package hook

import (
	"context"
	"fmt"
	"io"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Phase names accepted by Run.
const (
	PhaseCreateRuntime = "create-runtime"
	PhasePoststop      = "poststop"
)

// Run executes one hook phase ("create-runtime" or "poststop") with the OCI
// state read from stdin. Progress lines go to stderr. A non-nil error is
// self-contained (it names the container, the devices and what to do): the
// caller prints it and exits non-zero, which makes the runtime refuse the
// container.
func Run(ctx context.Context, phase string, cfg config.Config, stdin io.Reader, stderr io.Writer) error {
	_ = ctx
	_ = cfg
	_ = stdin
	_ = stderr
	return fmt.Errorf("nri-gpu-guard hook %s: not implemented yet", phase)
}
