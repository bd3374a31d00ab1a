/* The sandbox's init (PID 1, bubblewrap's --as-pid-1): starts the runner and reports its end.

   Usage: supervisor STATUS_FD REQUEST_FD UNDUMPABLE -- RUNNER ARGV...

   It forks; the child executes the runner (the warm Python interpreter that will run the
   code), the parent waits. When the runner ends, the parent writes the kernel's account of
   that end (wait4) on STATUS_FD as "D<exit code> <signal> <cpu seconds>\n", the same line the
   runner's own Python supervisor writes (tidal/sandbox/_runner.py), and exits, which ends the
   sandbox's PID namespace. Until then it reaps every orphan the code leaves.

   Why a program of its own: a supervisor forked from the warm interpreter shares its pages
   with the code's process, which then copies each page it writes; with this one the runner
   is a fresh process that shares nothing, and the supervisor itself is a few pages.

   Why it cannot be forged: as the namespace's init the kernel keeps every signal from inside
   away from it (it installs no handler), /proc/1 is masked (launch.py), the syscall filter
   denies ptrace (without the filter UNDUMPABLE=1 makes it non-dumpable), and once the runner
   has written its set-up report and closed its copy, only this process holds STATUS_FD.

   Built by tidal/sandbox/supervisor.py with the system's C compiler; nothing but libc. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return; /* the host went away: nobody left to tell */
        buf += n;
        len -= (size_t)n;
    }
}

static int parse_fd(const char *text) {
    char *end;
    long value = strtol(text, &end, 10);
    return (*text && !*end && value >= 0 && value < 1 << 20) ? (int)value : -1;
}

int main(int argc, char **argv) {
    char line[128];
    if (argc < 6 || strcmp(argv[4], "--") != 0) {
        fprintf(stderr, "usage: %s STATUS_FD REQUEST_FD UNDUMPABLE -- RUNNER ARGV...\n", argv[0]);
        return 125;
    }
    int status_fd = parse_fd(argv[1]), request_fd = parse_fd(argv[2]);
    if (status_fd < 0 || request_fd < 0) {
        fprintf(stderr, "supervisor: bad descriptor arguments\n");
        return 125;
    }
    if (strcmp(argv[3], "1") == 0 && prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
        int n = snprintf(line, sizeof line, "Esandbox supervisor cannot make itself non-dumpable: %s\n",
                         strerror(errno));
        write_all(status_fd, line, (size_t)n);
        return 125;
    }
    pid_t pid = fork();
    if (pid < 0) {
        int n = snprintf(line, sizeof line, "Esandbox supervisor cannot fork: %s\n", strerror(errno));
        write_all(status_fd, line, (size_t)n);
        return 125;
    }
    if (pid == 0) { /* the exec makes the runner dumpable again: it is the code's own process */
        execv(argv[5], argv + 5);
        int n = snprintf(line, sizeof line, "Esandbox supervisor cannot execute the runner: %s\n", strerror(errno));
        write_all(status_fd, line, (size_t)n);
        _exit(125);
    }
    close(request_fd); /* the runner's alone */
    int status = 0;
    struct rusage usage;
    for (;;) {
        pid_t reaped = wait4(-1, &status, 0, &usage);
        if (reaped == pid) break;
        if (reaped < 0 && errno != EINTR) return 125; /* cannot happen while the runner is our child */
    }
    double cpu_s = (double)usage.ru_utime.tv_sec + (double)usage.ru_stime.tv_sec
                   + ((double)usage.ru_utime.tv_usec + (double)usage.ru_stime.tv_usec) / 1e6;
    int exit_code = 0, signal_number = 0;
    if (WIFSIGNALED(status)) {
        exit_code = -1;
        signal_number = WTERMSIG(status);
    } else {
        exit_code = WEXITSTATUS(status);
    }
    int n = snprintf(line, sizeof line, "D%d %d %.3f\n", exit_code, signal_number, cpu_s);
    write_all(status_fd, line, (size_t)n);
    return signal_number ? 128 + signal_number : exit_code;
}
