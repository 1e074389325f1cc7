/* Small helpers shared by the core and backend plugins for their messages (header-only). */
#ifndef RECURRA_FORMAT_H
#define RECURRA_FORMAT_H

#include <stdint.h>
#include <stdio.h>

/* A byte count as the out-of-memory messages write it: "1.50 GiB (1610612736 bytes)",
 * "3.00 MiB (3145728 bytes)", "512 bytes". */
static inline void recurra_format_bytes(char* out, size_t size, uint64_t n) {
  const int gib = n >= (1ull << 30);
  if (n < (1ull << 20))
    snprintf(out, size, "%llu bytes", (unsigned long long)n);
  else
    snprintf(out, size, "%.2f %s (%llu bytes)", (double)n / (double)(gib ? 1ull << 30 : 1ull << 20),
             gib ? "GiB" : "MiB", (unsigned long long)n);
}

#endif /* RECURRA_FORMAT_H */
