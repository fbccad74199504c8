/* Probe: can a base-3 layout (5 trits per byte, 1.6 bits/weight, as TQ1_0) be unpacked as fast as
 * the tile16 2-bit codes stream? Every loop feeds vpdpbusd the same way (one operand per trit / code plane) over
 * the same number of weights (2^31 by default; argument 1: millions of weights, 4 = from cache), from buffers far
 * larger than the caches. Not part of the build:
 *     gcc -O2 -fopenmp bench/probes/base3_unpack.c -o /tmp/base3 && OMP_NUM_THREADS=2 /tmp/base3 [2000|4]
 * Decodes:
 *   LUT    trit n of every byte via a 256-entry table (2 x vpermi2b + blend per trit)
 *   mul    TQ1_0's arithmetic decode in 16-bit lanes (q = byte*3^n mod 256, trit = (q*3)>>8)
 *   carry  no decode at all: with q = ceil(v*256/243) and m_{n+1} = 3*m_n mod 256 (two byte adds),
 *          trit_n = (3*m_n - m_{n+1}) / 256 exactly, so sum_j trit_nj*x_j = (3*P - Q) / 256 with
 *          P = sum m_n . x_n and Q = sum m_{n+1} . x_n: two vpdpbusd and two vpaddb per trit, nothing else.
 * Results (README "Denser ternary layout"):
 *   Zen 3-class 2-core host, busy (an earlier session): LUT and mul took 2.5-3.2x the time of the 2-bit stream.
 *   Zen 4 2-core host, 2026-11-25 (streams 29 GB/s on 1 thread, 55 on 2): carry 1.04x the 2-bit time on 1
 *   thread and 0.99x on 2 from DRAM, 1.57x from cache: it is ALU-bound at ~22 GB/s of base-3 bytes per core
 *   (10 vpdpbusd per 64 bytes, 1 per cycle) while one core here streams 29 GB/s, so the 20% fewer bytes buy
 *   nothing on this machine; it would pay only where a core's share of the bandwidth is under ~20 GB/s.
 *   Not adopted either time. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline __m512i dp(__m512i acc, __m512i a, __m512i b){__asm__("vpdpbusd %2, %1, %0":"+v"(acc):"v"(a),"v"(b));return acc;}
/* Each loop below sums its share of the weights, p[0..per), as one thread; over_threads splits the n bytes at
 * w into one 64-byte-aligned share per OpenMP thread and adds up the loop's results. */
typedef int64_t (*share_loop)(const uint8_t *p, size_t per, const int8_t *x);
static int64_t over_threads(share_loop loop, const uint8_t *w, size_t n, const int8_t *x){
  int64_t tot=0;
  #pragma omp parallel reduction(+:tot)
  { int nt=omp_get_num_threads(), id=omp_get_thread_num(); size_t per=n/nt/64*64; tot+=loop(w+id*per,per,x); }
  return tot;
}
static uint8_t lut[5][256];   /* run3's table: trit k of every byte value */
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi")))
static int64_t run2bit(const uint8_t *p, size_t per, const int8_t *x){
  __m512i m0=_mm512_set1_epi8(3),m1=_mm512_set1_epi8(12),m2=_mm512_set1_epi8(48),m3=_mm512_set1_epi8((char)192);
  __m512i a0=_mm512_setzero_si512(),a1=a0,a2=a0,a3=a0;
  for(size_t i=0;i<per;i+=64){ __m512i v=_mm512_loadu_si512(p+i); const int8_t*xb=x+(i&4095);
    a0=dp(a0,_mm512_and_si512(v,m0),_mm512_set1_epi32(*(int32_t*)xb));
    a1=dp(a1,_mm512_and_si512(v,m1),_mm512_set1_epi32(*(int32_t*)(xb+4)));
    a2=dp(a2,_mm512_and_si512(v,m2),_mm512_set1_epi32(*(int32_t*)(xb+8)));
    a3=dp(a3,_mm512_and_si512(v,m3),_mm512_set1_epi32(*(int32_t*)(xb+12)));}
  return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)));
}
/* base-3: byte holds 5 trits; trit n of every byte via a 256-entry LUT (4 x vpermi2b halves + blend) */
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi")))
static int64_t run3(const uint8_t *p, size_t per, const int8_t *x){
  __m512i t[5][4]; for(int k=0;k<5;k++)for(int h=0;h<4;h++)t[k][h]=_mm512_loadu_si512(lut[k]+64*h);
  __m512i acc[5]; for(int k=0;k<5;k++)acc[k]=_mm512_setzero_si512();
  for(size_t i=0;i<per;i+=64){ __m512i v=_mm512_loadu_si512(p+i); const int8_t*xb=x+(i&4095);
    __mmask64 hi=_mm512_movepi8_mask(v);
    for(int k=0;k<5;k++){
      __m512i lo=_mm512_permutex2var_epi8(t[k][0],v,t[k][1]);
      __m512i up=_mm512_permutex2var_epi8(t[k][2],v,t[k][3]);
      __m512i u=_mm512_mask_blend_epi8(hi,lo,up);
      acc[k]=dp(acc[k],u,_mm512_set1_epi32(*(int32_t*)(xb+4*k)));}}
  __m512i s=acc[0]; for(int k=1;k<5;k++)s=_mm512_add_epi32(s,acc[k]); return _mm512_reduce_add_epi32(s);
}
/* base-3 arithmetic decode as TQ1_0 (q = byte*3^n mod 256, trit = (q*3)>>8), in 16-bit lanes */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static int64_t run3mul(const uint8_t *p, size_t per, const int8_t *x){
  const int pw[5]={1,3,9,27,81}; __m512i acc[5]; for(int k=0;k<5;k++)acc[k]=_mm512_setzero_si512();
  __m512i lo8=_mm512_set1_epi16(0xff), three=_mm512_set1_epi16(3);
  for(size_t i=0;i<per;i+=64){ __m512i v=_mm512_loadu_si512(p+i); const int8_t*xb=x+(i&4095);
    __m512i ev=_mm512_and_si512(v,lo8), od=_mm512_srli_epi16(v,8);
    for(int k=0;k<5;k++){ __m512i c=_mm512_set1_epi16(pw[k]);
      __m512i qe=_mm512_and_si512(_mm512_mullo_epi16(ev,c),lo8), qo=_mm512_and_si512(_mm512_mullo_epi16(od,c),lo8);
      __m512i te=_mm512_srli_epi16(_mm512_mullo_epi16(qe,three),8), to=_mm512_srli_epi16(_mm512_mullo_epi16(qo,three),8);
      __m512i u=_mm512_or_si512(te,_mm512_slli_epi16(to,8));
      acc[k]=dp(acc[k],u,_mm512_set1_epi32(*(int32_t*)(xb+4*k)));}}
  __m512i s=acc[0]; for(int k=1;k<5;k++)s=_mm512_add_epi32(s,acc[k]); return _mm512_reduce_add_epi32(s);
}
/* base-3 without decoding: P += m_n . x_n, Q += m_{n+1} . x_n, dot = (3P - Q) / 256 (see the header) */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static int64_t run3carry(const uint8_t *p, size_t per, const int8_t *x){
  __m512i P[5],Q[5]; for(int k=0;k<5;k++)P[k]=Q[k]=_mm512_setzero_si512();
  for(size_t i=0;i<per;i+=64){ __m512i m=_mm512_loadu_si512(p+i); const int8_t*xb=x+(i&4095);
    for(int k=0;k<5;k++){ __m512i xk=_mm512_set1_epi32(*(int32_t*)(xb+4*k));
      P[k]=dp(P[k],m,xk); m=_mm512_add_epi8(_mm512_add_epi8(m,m),m); Q[k]=dp(Q[k],m,xk);}}
  __m512i s=_mm512_setzero_si512();
  for(int k=0;k<5;k++)s=_mm512_add_epi32(s,_mm512_sub_epi32(_mm512_add_epi32(P[k],_mm512_add_epi32(P[k],P[k])),Q[k]));
  return _mm512_reduce_add_epi32(_mm512_srai_epi32(s,8));
}
int main(int argc, char **argv){
  size_t weights=(size_t)(argc>1?atol(argv[1]):2000)<<20; /* 2G weights ~ 4 models' worth of one pass? no: 0.5 GB at 2 bits */
  size_t n2=weights/4, n3=weights/5/64*64;
  uint8_t*w2=aligned_alloc(64,n2),*w3=aligned_alloc(64,n3); int8_t x[4096+64];
  for(size_t i=0;i<n2;i++)w2[i]=(uint8_t)(i*2654435761u>>7)&0x55; for(size_t i=0;i<n3;i++)w3[i]=(uint8_t)((i*2654435761u>>9)%243);
  for(int i=0;i<4160;i++)x[i]=(int8_t)(i*7);
  for(int b=0;b<256;b++){int v=b<243?b:0; for(int k=4;k>=0;k--){lut[k][b]=v%3;v/=3;}}
  double best2=1e9,best3=1e9,best3m=1e9,best3c=1e9; int64_t s=0;
  for(int r=0;r<5;r++){double t=now();s+=over_threads(run2bit,w2,n2,x);t=now()-t;if(t<best2)best2=t;
    t=now();s+=over_threads(run3,w3,n3,x);t=now()-t;if(t<best3)best3=t;
    t=now();s+=over_threads(run3mul,w3,n3,x);t=now()-t;if(t<best3m)best3m=t;
    t=now();s+=over_threads(run3carry,w3,n3,x);t=now()-t;if(t<best3c)best3c=t;}
  printf("threads %d, %zu M weights per pass\n", omp_get_max_threads(), weights>>20);
  printf("tile16 2-bit : %.1f ms  %.1f GB/s  %.2f Gweights/s\n",best2*1e3,n2/best2/1e9,weights/best2/1e9);
  printf("base-3 LUT   : %.1f ms  %.1f GB/s  %.2f Gweights/s  (%.2fx the 2-bit time)\n",best3*1e3,n3/best3/1e9,weights/best3/1e9,best3/best2);
  printf("base-3 mul   : %.1f ms  %.1f GB/s  %.2f Gweights/s  (%.2fx the 2-bit time)\n",best3m*1e3,n3/best3m/1e9,weights/best3m/1e9,best3m/best2);
  printf("base-3 carry : %.1f ms  %.1f GB/s  %.2f Gweights/s  (%.2fx the 2-bit time)\n",best3c*1e3,n3/best3c/1e9,weights/best3c/1e9,best3c/best2);
  return (int)(s&1)*0;
}
