// Package liveness is what the harness knows about other processes, read from
// Linux: whether a process is still alive (and still the same process, not
// a new one that reused its PID), and which command a process runs.
//
// It has no dependency on Kubernetes, so its tests build in seconds.
package liveness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrGone says a process no longer exists (or is a zombie, which has
// finished running and only waits to be reaped).
var ErrGone = errors.New("process is gone")

// Stat is what the harness reads of /proc/PID/stat.
type Stat struct {
	// State is field 3: R, S, D, Z (zombie), X (dead), ...
	State byte
	// StartTime is field 22: clock ticks after boot. With the PID it names
	// one process: a PID that is reused gets a later start time.
	StartTime uint64
}

// ParseStat parses the contents of /proc/PID/stat. The command name (field
// 2) is in parentheses and may itself hold spaces and parentheses, so the
// fields after it are counted from the last ')'.
func ParseStat(b []byte) (Stat, error) {
	end := bytes.LastIndexByte(b, ')')
	if end < 0 {
		return Stat{}, fmt.Errorf("no ')' after the command name in %q", abbreviate(b))
	}
	fields := strings.Fields(string(b[end+1:]))
	// fields[0] is field 3 (state), so field 22 (starttime) is fields[19].
	if len(fields) < 20 {
		return Stat{}, fmt.Errorf("%d fields after the command name, want at least 20, in %q", len(fields), abbreviate(b))
	}
	if len(fields[0]) != 1 {
		return Stat{}, fmt.Errorf("state %q is not one letter", fields[0])
	}
	start, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return Stat{}, fmt.Errorf("start time %q: %w", fields[19], err)
	}
	return Stat{State: fields[0][0], StartTime: start}, nil
}

// ReadStat reads /proc/PID/stat. A process that does not exist is ErrGone.
func ReadStat(pid int) (Stat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
		return Stat{}, fmt.Errorf("pid %d: %w", pid, ErrGone)
	}
	if err != nil {
		return Stat{}, err
	}
	return ParseStat(b)
}

func abbreviate(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "..."
	}
	return string(b)
}

// Cmdline returns the arguments of process pid. An empty list is not an
// error: the kernel shows no arguments for a process between the point of
// no return of execve and the new program's argument area being set up,
// and for a zombie. Callers must not read "empty" as "another program".
func Cmdline(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("pid %d: %w", pid, ErrGone)
		}
		return nil, err
	}
	b = bytes.TrimRight(b, "\x00")
	if len(b) == 0 {
		return nil, nil
	}
	return strings.Split(string(b), "\x00"), nil
}

// Handle follows one process for as long as it lives, immune to PID reuse:
// a pidfd, which the kernel makes readable when the process terminates.
type Handle struct {
	pid int
	fd  int
}

// Open takes a handle on process pid. ErrGone if there is no such process.
func Open(pid int) (*Handle, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("pid %d: not a process ID", pid)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil, fmt.Errorf("pid %d: %w", pid, ErrGone)
	}
	if err != nil {
		return nil, fmt.Errorf("pidfd_open(%d): %w", pid, err)
	}
	return &Handle{pid: pid, fd: fd}, nil
}

// Adopt takes over a pidfd inherited from the parent (which opened it while
// the process was certainly alive) as descriptor fd.
func Adopt(fd, pid int) *Handle {
	unix.CloseOnExec(fd)
	return &Handle{pid: pid, fd: fd}
}

// File returns the pidfd as a file to pass to a child (exec.Cmd.ExtraFiles);
// the file owns the descriptor: close one or the other, not both.
func (h *Handle) File() *os.File {
	return os.NewFile(uintptr(h.fd), fmt.Sprintf("pidfd:%d", h.pid))
}

// Exited reports whether the process has terminated, without waiting.
func (h *Handle) Exited() (bool, error) {
	return h.poll(0)
}

func (h *Handle) poll(timeout time.Duration) (bool, error) {
	fds := []unix.PollFd{{Fd: int32(h.fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, int(timeout/time.Millisecond))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return false, fmt.Errorf("poll pidfd of %d: %w", h.pid, err)
		}
		return n > 0, nil
	}
}

// Wait returns nil once the process has terminated, or ctx's error.
func (h *Handle) Wait(ctx context.Context) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		exited, err := h.poll(250 * time.Millisecond)
		if err != nil {
			return err
		}
		if exited {
			return nil
		}
	}
}

// Close releases the pidfd.
func (h *Handle) Close() error { return unix.Close(h.fd) }

// Child is a process this one started and will reap: whether it is alive is
// known exactly from its exit, never guessed from /proc.
type Child struct {
	cmd    *exec.Cmd
	exited chan struct{}
}

// Start starts cmd and reaps it in the background.
func Start(cmd *exec.Cmd) (*Child, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &Child{cmd: cmd, exited: make(chan struct{})}
	go func() { cmd.Wait(); close(c.exited) }()
	return c, nil
}

// Pid is the child's process ID.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Exited is closed once the child has exited and been reaped.
func (c *Child) Exited() <-chan struct{} { return c.exited }

// Alive reports whether the child has not exited yet.
func (c *Child) Alive() bool {
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}
