package enginesdk

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// TestMain doubles as an engine binary built on Main (the probe engine),
// when the process tests start this test binary with CTXGATE_SDK_ENGINE=1.
func TestMain(m *testing.M) {
	if os.Getenv("CTXGATE_SDK_ENGINE") == "1" {
		os.Args = append([]string{"probe-engine"}, os.Args[1:]...)
		Main(func(Options) (Engine, error) {
			p := newProbe()
			go func() {
				for range p.started {
				}
			}()
			go func() {
				for range p.seen {
				}
			}()
			return p, nil
		})
		return
	}
	os.Exit(m.Run())
}

// engineCommand is this test binary run as the probe engine with args.
func engineCommand(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "CTXGATE_SDK_ENGINE=1")
	return cmd
}

func TestTheProcessListensOnAUnixSocketAnswersHealthAndDrainsOnSIGTERM(t *testing.T) {
	dir := t.TempDir()
	socket := "unix://" + filepath.Join(dir, "engine.sock")
	cmd := engineCommand("--listen", socket, "--max-concurrent-calls", "4", "--drain-seconds", "5")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill() }()
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "listening on "+socket {
		t.Fatalf("first line %q (stderr %s)", lines.Text(), stderr.String())
	}
	info, err := os.Stat(filepath.Join(dir, "engine.sock"))
	if err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, %v; want 0600", info.Mode().Perm(), err)
	}

	health := engineCommand("health", "--endpoint", socket)
	out, err := health.Output()
	if err != nil || strings.TrimSpace(string(out)) != "SERVING" {
		t.Fatalf("health subcommand: %q, %v", out, err)
	}

	conn := dial(t, socket)
	client := pb.NewContextEngineClient(conn)
	watch, err := healthpb.NewHealthClient(conn).Watch(context.Background(),
		&healthpb.HealthCheckRequest{Service: contract.EngineService})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("first status %v, %v", r, err)
	}
	inFlight := make(chan error, 1)
	go func() { _, err := client.Assemble(timeout(10*time.Second), assembleReq("slow")); inFlight <- err }()
	time.Sleep(100 * time.Millisecond) // the call reaches the engine ("slow" takes 300 ms)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("status after SIGTERM %v, %v", r, err)
	}
	_, err = client.Assemble(timeout(5*time.Second), assembleReq("s"))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a new call after SIGTERM: %v", err)
	}
	if err := next(t, inFlight); err != nil {
		t.Fatalf("the in-flight call: %v", err)
	}
	for lines.Scan() {
		t.Errorf("stdout carries one line only; also %q", lines.Text())
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after the drain: %v (stderr %s)", err, stderr.String())
	}
	if _, err := os.Stat(filepath.Join(dir, "engine.sock")); !os.IsNotExist(err) {
		t.Fatalf("the socket file is left behind: %v", err)
	}
	var why bytes.Buffer
	health = engineCommand("health", "--endpoint", socket, "--timeout-seconds", "1")
	health.Stderr = &why
	if err := health.Run(); err == nil || !strings.Contains(why.String(), "the engine at "+socket) {
		t.Fatalf("health of a stopped engine: %v, %q", err, why.String())
	}
}

func TestABadFlagIsASentenceAndExitOne(t *testing.T) {
	var stderr bytes.Buffer
	cmd := engineCommand("--listen", "ftp://nowhere")
	cmd.Stderr = &stderr
	err := cmd.Run()
	if exit, ok := err.(*exec.ExitError); !ok || exit.ExitCode() != 1 ||
		!strings.Contains(stderr.String(), `--listen: invalid endpoint "ftp://nowhere"`) {
		t.Fatalf("%v: %s", err, stderr.String())
	}
}
