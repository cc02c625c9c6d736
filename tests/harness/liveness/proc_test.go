package liveness

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	tail := " 1 1 1 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10"
	cases := []struct {
		name  string
		in    string
		state byte
		start uint64
		err   bool
	}{
		{"plain", "42 (bash) S" + tail, 'S', 987654, false},
		{"name with spaces and parentheses", "42 (a (b) c) R" + tail, 'R', 987654, false},
		{"name that looks like fields", "42 (x) S 1 2 3) Z" + tail, 'Z', 987654, false},
		{"zombie", "42 (sleep) Z" + tail, 'Z', 987654, false},
		{"truncated", "42 (bash) S 1 1 1", 0, 0, true},
		{"no command name", "42 bash S" + tail, 0, 0, true},
		{"start time not a number", "42 (bash) S 1 1 1 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 soon 1000 10", 0, 0, true},
		{"empty", "", 0, 0, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseStat([]byte(c.in))
			if c.err {
				if err == nil {
					t.Fatalf("ParseStat(%q) = %+v, want an error", c.in, got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.State != c.state || got.StartTime != c.start {
				t.Fatalf("ParseStat(%q) = %c %d, want %c %d", c.in, got.State, got.StartTime, c.state, c.start)
			}
		})
	}
}

func TestReadStatOfThisProcessIsStable(t *testing.T) {
	a, err := ReadStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ReadStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if a.StartTime == 0 || a.StartTime != b.StartTime || a.State == 'Z' {
		t.Fatalf("stat of a live process: %+v then %+v", a, b)
	}
}

// reaped starts a process, lets it exit and reaps it: its PID then names no
// process (until reused, which takes the PID space to wrap).
func reaped(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("/bin/true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid
}

func TestAReapedProcessIsGone(t *testing.T) {
	pid := reaped(t)
	if _, err := ReadStat(pid); !errors.Is(err, ErrGone) {
		t.Fatalf("ReadStat of reaped pid %d: %v, want ErrGone", pid, err)
	}
	if _, err := Cmdline(pid); !errors.Is(err, ErrGone) {
		t.Fatalf("Cmdline of reaped pid %d: %v, want ErrGone", pid, err)
	}
	if _, err := Open(pid); !errors.Is(err, ErrGone) {
		t.Fatalf("Open of reaped pid %d: %v, want ErrGone", pid, err)
	}
}

func TestAHandleSeesItsProcessExitAndNothingBefore(t *testing.T) {
	cmd := exec.Command("/bin/sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h, err := Open(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if exited, err := h.Exited(); err != nil || exited {
		t.Fatalf("a running process: exited=%v err=%v", exited, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	if err := h.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait on a running process returned %v", err)
	}
	cancel()
	cmd.Process.Kill()
	// The handle fires on termination, before (and whether or not) the parent reaps it.
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Wait(ctx); err != nil {
		t.Fatalf("Wait after kill: %v", err)
	}
	cmd.Wait()
}

func TestAHandlePassedToAChildFollowsTheSameProcess(t *testing.T) {
	owner := exec.Command("/bin/sleep", "30")
	if err := owner.Start(); err != nil {
		t.Fatal(err)
	}
	defer owner.Process.Kill()
	h, err := Open(owner.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	f := h.File()
	defer f.Close()
	// The child checks the inherited descriptor 3: exit 0 while the owner runs.
	child := exec.Command("/bin/sh", "-c", "test -e /proc/self/fd/3")
	child.ExtraFiles = []*os.File{f}
	if out, err := child.CombinedOutput(); err != nil {
		t.Fatalf("the child did not inherit the pidfd: %v %s", err, out)
	}
	adopted := Adopt(int(f.Fd()), owner.Process.Pid)
	if exited, err := adopted.Exited(); err != nil || exited {
		t.Fatalf("adopted handle on a running owner: exited=%v err=%v", exited, err)
	}
}

// The race behind "supervisor exited before it was ready": right after
// exec.Cmd.Start returns, the kernel may still show an empty command line
// for the child. A liveness check must not read that as "gone".
func TestAStartedChildIsAliveFromTheFirstCheck(t *testing.T) {
	empty := 0
	for i := 0; i < 200; i++ {
		c, err := Start(exec.Command("/bin/sleep", "30"))
		if err != nil {
			t.Fatal(err)
		}
		if args, _ := Cmdline(c.Pid()); len(args) == 0 {
			empty++
		}
		if !c.Alive() {
			t.Fatalf("child %d declared gone right after it started", c.Pid())
		}
		c.cmd.Process.Kill()
		select {
		case <-c.Exited():
		case <-time.After(10 * time.Second):
			t.Fatalf("child %d: no exit seen 10s after SIGKILL", c.Pid())
		}
		if c.Alive() {
			t.Fatalf("child %d declared alive after it exited", c.Pid())
		}
	}
	t.Logf("the command line was still empty at the first check in %d of 200 starts", empty)
}
