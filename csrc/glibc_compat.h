/* Force-included into every C file by setup.py (`-include`), never included by hand.
 *
 * glibc 2.34 moved libdl and libpthread into libc and gave the moved functions a new symbol
 * version; a build on a newer system therefore binds dlopen@GLIBC_2.34 and the extension refuses
 * to load on older ones (auditwheel then finds no manylinux tag it satisfies). The same functions
 * are still exported under the version they had before, which every glibc since 2.17 defines, in
 * libdl.so.2 / libpthread.so.0 before 2.34 and in libc.so.6 after: binding that one keeps the wheel
 * manylinux2014 (glibc 2.17) while building on any host. setup.py links -ldl -pthread so that an
 * old glibc's loader has those libraries in scope. */
#ifndef SYNCLESS_GLIBC_COMPAT_H
#define SYNCLESS_GLIBC_COMPAT_H

#if defined(__linux__) && !defined(__ASSEMBLER__)
#if defined(__x86_64__)
#define SL_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define SL_GLIBC_BASE "GLIBC_2.17"
#endif
#ifdef SL_GLIBC_BASE
__asm__(".symver dlopen,dlopen@" SL_GLIBC_BASE);
__asm__(".symver dlsym,dlsym@" SL_GLIBC_BASE);
__asm__(".symver dlerror,dlerror@" SL_GLIBC_BASE);
__asm__(".symver dlclose,dlclose@" SL_GLIBC_BASE);
__asm__(".symver pthread_kill,pthread_kill@" SL_GLIBC_BASE);
__asm__(".symver pthread_sigmask,pthread_sigmask@" SL_GLIBC_BASE);
#endif
#endif

#endif
