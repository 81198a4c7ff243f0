// Package conformance runs containerd's own snapshotter test suite against `shoal node`.
//
// Every case of testsuite.SnapshotterSuite gets a fresh shoal node process (its own
// --root in the case's directory and its own socket) and talks to it through
// containerd's snapshots/proxy client, exactly as containerd does for a proxy plugin.
//
// Built in GOPATH mode against Debian's golang-github-containerd-containerd-dev
// (containerd 1.6 sources); tests/test_snapshotter.py builds and runs it. Environment:
//
//	SHOAL_BIN       the shoal executable (required; the test is skipped without it)
//	SHOAL_LOG_DIR   where each case's node log is kept (default: discarded with the case)
//
// Needs root and overlayfs, like the suite itself.
package conformance

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/pkg/dialer"
	"github.com/containerd/containerd/snapshots"
	"github.com/containerd/containerd/snapshots/proxy"
	"github.com/containerd/containerd/snapshots/testsuite"
	"google.golang.org/grpc"
)

const (
	startTimeout = 30 * time.Second
	stopTimeout  = 10 * time.Second
)

func TestShoalSnapshotter(t *testing.T) {
	bin := os.Getenv("SHOAL_BIN")
	if bin == "" {
		t.Skip("SHOAL_BIN is not set")
	}
	if os.Getuid() != 0 {
		t.Skip("the snapshotter suite needs root (overlay mounts)")
	}
	testsuite.SnapshotterSuite(t, "Shoal", newShoalSnapshotter(bin))
}

// newShoalSnapshotter starts `shoal node` for one case and returns a proxy snapshotter
// talking to it, and a function that stops the process by its PID.
func newShoalSnapshotter(bin string) testsuite.SnapshotterFunc {
	return func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		caseDir := filepath.Dir(root)
		sock := filepath.Join(caseDir, "shoal.sock")
		logPath := filepath.Join(caseDir, "node.log")
		if dir := os.Getenv("SHOAL_LOG_DIR"); dir != "" {
			logPath = filepath.Join(dir, filepath.Base(caseDir)+".log")
		}
		logFile, err := os.Create(logPath)
		if err != nil {
			return nil, nil, err
		}
		cmd := exec.Command(bin, "-vv", "node", "--root", root, "--socket", sock)
		cmd.Stdout, cmd.Stderr = logFile, logFile
		if err := cmd.Start(); err != nil {
			logFile.Close()
			return nil, nil, err
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()

		stop := func() error {
			defer logFile.Close()
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case err := <-exited:
				if err != nil {
					return fmt.Errorf("shoal node (pid %d, log %s): %w", cmd.Process.Pid, logPath, err)
				}
				return nil
			case <-time.After(stopTimeout):
				_ = cmd.Process.Kill()
				<-exited
				return fmt.Errorf("shoal node (pid %d) did not stop within %s; killed", cmd.Process.Pid, stopTimeout)
			}
		}

		deadline := time.Now().Add(startTimeout)
		for {
			if _, err := os.Stat(sock); err == nil {
				break
			}
			select {
			case err := <-exited:
				exited <- err
				stop()
				return nil, nil, fmt.Errorf("shoal node exited before listening (%v); log %s", err, logPath)
			case <-time.After(20 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				stop()
				return nil, nil, fmt.Errorf("shoal node did not create %s within %s; log %s", sock, startTimeout, logPath)
			}
		}

		dialCtx, cancel := context.WithTimeout(ctx, startTimeout)
		defer cancel()
		conn, err := grpc.DialContext(dialCtx, dialer.DialAddress(sock),
			grpc.WithInsecure(), // the packaged grpc has no credentials/insecure
			grpc.WithContextDialer(dialer.ContextDialer),
			grpc.WithBlock(),
		)
		if err != nil {
			stop()
			return nil, nil, fmt.Errorf("dial %s: %w", sock, err)
		}
		sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "shoal")
		return sn, func() error {
			conn.Close()
			return stop()
		}, nil
	}
}
