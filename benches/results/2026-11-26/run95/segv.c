// LD_PRELOAD'ed into a test binary: on SIGSEGV/SIGBUS, print the faulting address and the
// backtrace, then die.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
static void handler(int sig, siginfo_t *si, void *ctx) {
  char buf[256];
  int n = snprintf(buf, sizeof buf, "\n=== SIGNAL %d at address %p, thread %ld\n", sig, si->si_addr, (long)syscall(SYS_gettid));
  write(2, buf, n);
  void *frames[64];
  int k = backtrace(frames, 64);
  backtrace_symbols_fd(frames, k, 2);
  signal(sig, SIG_DFL); raise(sig);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa; memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler; sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  static char stack[1 << 16]; stack_t ss = { .ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0 }; sigaltstack(&ss, 0);
  sigaction(SIGSEGV, &sa, 0); sigaction(SIGBUS, &sa, 0);
}
